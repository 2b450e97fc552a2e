"""The one table of bench/gpu_checks.sh: what the benches measured on this GPU, against the
goals and the figures of the last GPU run before this work.

    python -m bench.gpu_table RESULTS_DIR

Each bench run by gpu_checks.sh writes its figures as JSON into RESULTS_DIR (`--json`); a
missing file (a bench that failed or timed out) shows as "not measured". Goals (one H200,
bf16, rembert, micro-batch 16 x 512): model step >= 45% MFU, trainer step >= 43% MFU at gas 8,
trainer / bare model >= 0.95 at gas 8 and >= 0.9 at gas 1, FP8 >= 1.25x bf16 tokens/s,
embedding fwd + bwd <= 0.3 ms, head fwd + bwd <= 2.5 layers, no host sync inside a micro-batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# What each bench writes (--json), file by file: the keys this table reads. The benches' tests
# check their files against it.
SCHEMA = {
    "model": {"variants", "best"},  # train_throughput.py --gpu-only
    "engine": {"rows", "sync_debug"},  # train_throughput.py --engine
    "parts": {"embedding_ms", "layer_ms", "head_ms"},  # pipeline_balance.py
    "layer": {"eager_ms", "compiled_ms", "matmuls_ms", "speedup"},  # layer_fusion.py
    "head": {"best", "layer_ms"},  # kernels_gpu.py
    "fp8": {"fp8_over_bf16", "fp8_tokens_per_s", "fp8_mfu", "loss_ratio"},  # fp8_gpu.py
}
ENGINE_ROW = {"gas", "bare", "trainer", "optimizer", "trainer_metrics"}
STEP = {"tokens_per_s", "tflops", "mfu", "memory_gib"}  # a model or trainer step's figures
# The smallest run: an empty folder, every line "not measured" (tests/bench/test_every_bench.py).
TINY_ARGS = ["{tmp}"]

# The README's H200 figures before this work (torch 2.11, bf16, 16 x 512).
BEFORE = {
    "model_mfu": "36.7-37.8% (99-102k tokens/s)",
    "trainer_mfu": "25.9-27.9% at gas 2 (70-75k tokens/s)",
    "embedding_ms": "1.23 ms",
    "layer_ms": "2.42 ms (~347 TFLOP/s)",
    "head_layers": "10.0 ms = 4.1 layers",
}


def _load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _met(ok: bool | None) -> str:
    return {True: "yes", False: "NO", None: "?"}[ok]


def rows(folder: Path) -> list[tuple[str, str, str, str, str]]:
    """(what, measured, goal, met, before) for every line of the table."""
    out = []
    model, engine, parts = _load(folder, "model"), _load(folder, "engine"), _load(folder, "parts")
    layer, head, fp8 = _load(folder, "layer"), _load(folder, "head"), _load(folder, "fp8")
    missing = ("not measured", "", "?", "")

    if model:
        for name, r in model["variants"].items():
            goal = ">= 45% MFU" if name == model.get("best") else ""
            ok = r["mfu"] >= 0.45 if goal and r["mfu"] is not None else None
            out.append((f"model step bf16, {name}",
                        f"{r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.0f} TFLOP/s, MFU "
                        f"{_pct(r['mfu'])}, {r['memory_gib']:.1f} GiB", goal,
                        _met(ok) if goal else "", BEFORE["model_mfu"] if goal else ""))
    else:
        out.append(("model step bf16", *missing))
    if engine:
        for r in engine["rows"]:
            gas = r["gas"]
            t = r["trainer_metrics"]
            goal_mfu = 0.43 if gas == 8 else None
            out.append((f"trainer step bf16, gas {gas}",
                        f"{t['tokens_per_s']:,.0f} tok/s, {t['tflops']:.0f} TFLOP/s, MFU "
                        f"{_pct(t['mfu'])}, {t['memory_gib']:.1f} GiB",
                        ">= 43% MFU" if goal_mfu else "",
                        _met(t["mfu"] >= goal_mfu) if goal_mfu and t["mfu"] else "",
                        BEFORE["trainer_mfu"] if goal_mfu else ""))
            ratio = r["bare"] / r["trainer"]
            goal = 0.95 if gas >= 8 else 0.9
            out.append((f"trainer / bare model + fused AdamW, gas {gas}",
                        f"{ratio:.3f} (engine {1e3 * (r['trainer'] - r['bare']):.1f} ms/step, "
                        f"optimizer {1e3 * r['optimizer']:.1f} ms)", f">= {goal}",
                        _met(ratio >= goal), ""))
            if r.get("bare_mixed"):  # the plain mixed-precision loop (fp32 masters)
                mixed = r["bare_mixed"] / r["trainer"]
                out.append((f"trainer / bare mixed-precision loop, gas {gas}",
                            f"{mixed:.3f} (engine {1e3 * (r['trainer'] - r['bare_mixed']):.1f} "
                            "ms/step)", "", "", ""))
        sync = engine.get("sync_debug")
        out.append(("host syncs in a micro-batch (sync_debug_mode error)", str(sync),
                    "clean", _met(sync == "clean") if sync else "?", "nonzero in the loss"))
    else:
        out.append(("trainer step", *missing))
    if fp8:
        ratio = fp8.get("fp8_over_bf16")
        out.append(("model step fp8 / bf16 tokens/s", "n/a" if ratio is None else
                    f"{ratio:.3f}x (fp8 {fp8.get('fp8_tokens_per_s', 0):,.0f} tok/s, MFU "
                    f"{_pct(fp8.get('fp8_mfu'))})", ">= 1.25x",
                    _met(ratio >= 1.25) if ratio else "?", ""))
        if fp8.get("loss_ratio") is not None:
            out.append(("demo model 300 steps, final loss fp8 / bf16",
                        f"{fp8['loss_ratio']:.4f}", "within 5%",
                        _met(abs(fp8["loss_ratio"] - 1) <= 0.05), ""))
    else:
        out.append(("model step fp8", *missing))
    layer_ms = None
    if parts:
        layer_ms = parts["layer_ms"]
        out.append(("embedding fwd + bwd (into fp32 main grads)",
                    f"{parts['embedding_ms']:.3f} ms = {parts['embedding_ms'] / layer_ms:.2f} "
                    "layers", "<= 0.3 ms", _met(parts["embedding_ms"] <= 0.3),
                    BEFORE["embedding_ms"]))
        out.append(("Transformer layer fwd + bwd (as trained)", f"{layer_ms:.3f} ms", "", "",
                    BEFORE["layer_ms"]))
    else:
        out.append(("embedding, layer", *missing))
    if layer:
        out.append(("layer eager / compiled / GEMMs + attention alone",
                    f"{layer['eager_ms']:.3f} / {layer['compiled_ms']:.3f} / "
                    f"{layer['matmuls_ms']:.3f} ms (compiled {layer['speedup']:.2f}x)",
                    "", "", ""))
    if head:
        best = head["best"]
        ms = best["ms"]
        per_layer = layer_ms or head.get("layer_ms")
        layers = ms / per_layer if per_layer else None
        out.append((f"MLM head + loss fwd + bwd ({best['setting']})",
                    f"{ms:.2f} ms" + (f" = {layers:.2f} layers" if layers else "")
                    + f", extra {best['extra_gib']:.2f} GiB", "<= 2.5 layers",
                    _met(layers <= 2.5) if layers else "?", BEFORE["head_layers"]))
    else:
        out.append(("MLM head", *missing))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(__doc__)
    table = rows(Path(argv[0]))
    widths = [max(len(r[i]) for r in table + [("what", "measured", "goal", "met", "before")])
              for i in range(5)]
    header = ("what", "measured", "goal", "met", "before this work")
    print("\n" + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in table:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
