"""Detection cost of a full-size model on meta, next to the cost of building it on meta.

    python bench/detect.py            # DeepSeek-V3 (61 layers, 256 routed experts), cold and warm caches

Target (issue 2): detecting every MoE block costs < 5% of the meta build and < 50 ms.
"""
import time

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from autoep import detect_moe_structure
    from autoep.detect.structure import clear_caches

    config = DeepseekV3Config()  # the published full-size shape: 61 layers, 256 routed experts
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    build_s = time.perf_counter() - t0
    blocks = [m for _, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")]

    def detect_all() -> float:
        t = time.perf_counter()
        for block in blocks:
            detect_moe_structure(block)
        return time.perf_counter() - t

    clear_caches()
    cold_s = detect_all()  # parses each class's source once
    warm_s = min(detect_all() for _ in range(3))
    print(f"model: DeepseekV3 {config.num_hidden_layers} layers, {config.n_routed_experts} experts, {len(blocks)} MoE blocks")
    print(f"meta build      : {build_s * 1e3:9.1f} ms")
    print(f"detect (cold)   : {cold_s * 1e3:9.1f} ms  = {cold_s / build_s:.2%} of build")
    print(f"detect (warm)   : {warm_s * 1e3:9.1f} ms  = {warm_s / build_s:.2%} of build")
    print(f"target          : < 5% of build and < 50 ms -> {'met' if cold_s < 0.05 * build_s and cold_s < 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
