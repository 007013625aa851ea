"""The projection half of ``launch.project_scaling``: scaling efficiency from measured inputs
(:func:`project`), the dense case checked against Horovod's published figures
(:func:`sanity_check`), and the markdown table.  Plain Python over the alpha-beta model of
:mod:`tf_blocksparse.planning.projection`; the measurements live in the script's body,
:mod:`launch.benches.scaling`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tf_blocksparse.planning import projection

#: Published single-P100 step times at batch 64 (see the module docstring): assumptions.
#: The projection's default cluster sizes and link rates (Gbit/s).
DEFAULT_WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_BANDWIDTHS = (1.0, 10.0, 25.0, 100.0)
GPU_COMPUTE_S = {"resnet50": 64 / 219, "vgg16": 64 / 154, "resnet101": 64 / 129}
GPU_SOURCE = ("TensorFlow performance benchmarks (tf_cnn_benchmarks), NVIDIA DGX-1, 1x Tesla "
              "P100, batch 64, synthetic data, May 2017: ResNet-50 219 img/s, VGG-16 154 "
              "img/s; ResNet-101 interpolated by FLOPs between ResNet-50 and ResNet-152 "
              "(91.8 img/s): ~129 img/s. Assumed, not measured here.")
#: Horovod's published scaling efficiency, 512 GPUs (128 hosts x 4 Pascal GPUs), 25 Gbit/s.
HOROVOD = {"resnet101": 0.90, "vgg16": 0.68}
HOROVOD_SOURCE = ("Horovod README / Sergeev & Del Balso 2018 (arXiv:1802.05799): 90% for "
                  "Inception V3 and ResNet-101, 68% for VGG-16, 512 Pascal GPUs, 25 Gbit/s "
                  "RoCE")


def selection_label(sel: Mapping[str, Any]) -> str:
    return f"k={sel['k']}" if sel["k"] is not None else f"density={sel['density']:g}"


def estimate_gpu_select_s(sel: Mapping[str, Any], dense_bytes: int, gpu_mem_gbps: float,
                  override: float | None) -> float:
    """The GPU selection time: ``override``, else the CPU ratio x a modelled GPU pass."""
    if override is not None:
        return override
    ratio = sel["select_s_cpu"] / sel["accumulate_pass_s_cpu"]
    return ratio * 3 * dense_bytes / (gpu_mem_gbps * 1e9)


def project(models: Mapping[str, Mapping[str, Any]], workers: Sequence[int],
            bandwidths_gbit: Sequence[float], alpha_s: float, overlap: float,
            gpu_compute_s: Mapping[str, float]) -> list[dict[str, Any]]:
    """Every (model, compute source, bandwidth, workers, mode, selection) projection."""
    rows = []
    for name, m in models.items():
        sources = {"cpu_measured": m["cpu_compute_s"]}
        if name in gpu_compute_s:
            sources["gpu_assumed"] = gpu_compute_s[name]
        for source, compute in sources.items():
            for bw in bandwidths_gbit:
                net = projection.NetworkModel(bw, alpha_s)
                for p in workers:
                    cases: list[tuple[str, str | None, dict[str, Any]]] = [
                        ("dense", None, {"dense_bytes": m["tensor_bytes"]}),
                        ("dense_per_tensor", None,
                         {"dense_bytes": m["tensor_bytes"], "fused": False})]
                    for label, sel in m["selections"].items():
                        sel_s = sel["select_s_cpu"] if source == "cpu_measured" \
                            else sel["select_s_gpu"]
                        cases.append(("allgather", label, {
                            "id_bytes": sum(sel["id_bytes"]) + 4,
                            "value_bytes": sel["value_bytes"], "select_s": sel_s}))
                        cases.append(("shared", label, {
                            "score_bytes": sel["score_bytes"],
                            "value_bytes": sel["value_bytes"], "select_s": sel_s}))
                    for mode, label, kw in cases:
                        cost = projection.exchange_cost(
                            "dense" if mode == "dense_per_tensor" else mode, p, net, compute,
                            overlap=overlap, **kw)
                        rows.append({
                            "model": name, "compute": source, "mode": mode,
                            "selection": label, "workers": p, "bandwidth_gbit": bw,
                            "compute_s": compute, "comm_s": cost.comm_s,
                            "select_s": cost.extra_s,
                            "efficiency_no_overlap": round(cost.efficiency, 4),
                            "efficiency_overlap": round(cost.efficiency_overlap, 4)})
    return rows


def sanity_check(sizes: Mapping[str, int], alpha_s: float, overlap: float,
                 gpu_compute_s: Mapping[str, float]) -> dict[str, Any]:
    """Dense fused ring all-reduce at 512 workers, 25 Gbit/s, beside Horovod's figures."""
    net = projection.NetworkModel(25.0, alpha_s)
    entries = []
    for name, published in HOROVOD.items():
        if name not in sizes or name not in gpu_compute_s:
            continue
        cost = projection.exchange_cost("dense", 512, net, gpu_compute_s[name],
                                     dense_bytes=sizes[name], overlap=overlap)
        lo, hi = cost.efficiency, cost.efficiency_overlap
        entries.append({
            "model": name, "dense_bytes": sizes[name], "compute_s": gpu_compute_s[name],
            "comm_s": cost.comm_s, "horovod_efficiency": published,
            "projected_no_overlap": round(lo, 4), "projected_overlap": round(hi, 4),
            "within_band": bool(lo - 0.05 <= published <= hi + 0.05)})
    return {"reference": HOROVOD_SOURCE, "workers": 512, "bandwidth_gbit": 25.0,
            "compute_source": GPU_SOURCE, "band_tolerance": 0.05, "entries": entries}


def markdown_table(result: Mapping[str, Any], compute: str = "gpu_assumed") -> str:
    """Markdown: per model and bandwidth, efficiency (% no overlap / % overlap) per mode."""
    rows = [r for r in result["projections"] if r["compute"] == compute]
    if not rows:
        return ""
    workers = result["workers"]
    lines = [f"Scaling efficiency, compute `{compute}`, in % as no-overlap / "
             f"{result['assumptions']['overlap']:.2f}-overlap (alpha "
             f"{result['assumptions']['alpha_s'] * 1e6:g} us)", ""]
    for model in result["models"]:
        for bw in result["bandwidths_gbit"]:
            sel = [r for r in rows if r["model"] == model and r["bandwidth_gbit"] == bw]
            if not sel:
                continue
            lines += [f"**{model}, {bw:g} Gbit/s**", "",
                      "| mode | " + " | ".join(str(w) for w in workers) + " |",
                      "|---|" + "---|" * len(workers)]
            keys = list(dict.fromkeys((r["mode"], r["selection"]) for r in sel))
            for mode, label in keys:
                cells = []
                for w in workers:
                    r = next(x for x in sel if (x["mode"], x["selection"], x["workers"])
                             == (mode, label, w))
                    cells.append(f"{100 * r['efficiency_no_overlap']:.0f} / "
                                 f"{100 * r['efficiency_overlap']:.0f}")
                name = mode if label is None else f"{mode} {label}"
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """Per model: sizes, ratios, and the gpu_assumed efficiencies at 1024 workers, 25 Gbit/s."""
    out = {}
    for name, m in result["models"].items():
        best = {}
        for r in result["projections"]:
            if (r["model"], r["compute"], r["workers"], r["bandwidth_gbit"]) == (
                    name, "gpu_assumed", max(result["workers"]), 25.0):
                key = r["mode"] if r["selection"] is None else f"{r['mode']} {r['selection']}"
                best[key] = [r["efficiency_no_overlap"], r["efficiency_overlap"]]
        out[name] = {
            "parameters": m["parameters"], "dense_mb": round(m["dense_bytes"] / 1e6, 2),
            "cpu_compute_s": round(m["cpu_compute_s"], 3),
            "ratios": {lab: [s["compression_ratio_allgather"], s["compression_ratio_shared"]]
                       for lab, s in m["selections"].items()},
            f"efficiency_gpu_{max(result['workers'])}w_25gbit": best}
    return out
