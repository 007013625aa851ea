"""Plan pipeline training of a registry model on a cluster and draw the plan.

    python -m launch.plan_pipeline --model=cnn_small --topology=random --num_devices=4 \\
        --profile_repeats=3 --out=/tmp/plan_cnn_small
    python -m launch.plan_pipeline --topology=two_level --num_devices=8 --devices_per_node=4
    python -m launch.plan_pipeline --profile_json=P.json --topology_json=T.json --out=DIR

1. Profile ``--model`` (an image model of ``models/registry.py``) layer by layer by real runs
   at the micro-batch size ``--batch_size`` (``tfbs.profile_model``: median of
   ``--profile_repeats`` timed calls after ``--profile_warmup``; non-chain graphs such as
   ``resnet20`` in topological order), or read ``--profile_json``.  The input shape is
   ``--input_shape`` or the ``--dataset``'s (no data are loaded: random inputs).
2. Read ``--topology_json`` or build ``--topology``: ``homogeneous`` (every link
   ``--bandwidth_gbit``), ``two_level`` (``--devices_per_node`` per node,
   ``--intra_bandwidth_gbit`` inside, ``--inter_bandwidth_gbit`` across) or ``random``
   (links uniform in ``[(1 - --spread), 1] x --bandwidth_gbit``, ``--seed``).
3. Plan with ``plan_pipeline`` (bandwidth order + min-max DP) and the baselines
   ``plan_pipedream`` (hierarchical when the topology has levels) and ``plan_oblivious``, all
   evaluated with the same cost model; print each plan as a table and the bottlenecks.
4. Write under ``--out``: ``plan.json`` (the DP's plan, ``PipelinePlan.to_json``),
   ``plan_pipedream.json``, ``plan_oblivious.json``, ``profile.json``, ``topology.json``,
   ``comparison.json`` and ``stages.png`` (per plan: devices x layers coloured by stage, and
   each stage's time split into compute, incoming activations and parameter sync).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from absl import app, flags

from launch import script

if TYPE_CHECKING:
    from tf_blocksparse.planning import ModelProfile, PipelinePlan, Topology

FLAGS = flags.FLAGS
IMAGE_MODELS = ["cnn_small", "resnet20", "vgg_fc"]
DATASET_SHAPES = {"fashion_mnist": (28, 28, 1), "digits": (8, 8, 1)}
GBIT = 1e9 / 8  # bytes/s in one Gbit/s
MS = 1e3


def define_flags() -> None:
    """Defines the script's flags (only called when run as a script)."""
    flags.DEFINE_enum("model", "cnn_small", IMAGE_MODELS, "Image model from models/.")
    flags.DEFINE_enum("dataset", "fashion_mnist", sorted(DATASET_SHAPES),
                      "Gives the default --input_shape (fashion_mnist 28x28x1, digits 8x8x1).")
    flags.DEFINE_list("input_shape", [], "Per-sample input shape H,W,C (default: --dataset's).")
    flags.DEFINE_integer("num_classes", 10, "Logits of the model.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 32, "Micro-batch size the layers are profiled at.",
                         lower_bound=1)
    flags.DEFINE_integer("profile_warmup", 1, "Untimed calls per profiled layer function.",
                         lower_bound=0)
    flags.DEFINE_integer("profile_repeats", 3, "Timed calls per profiled layer function "
                         "(median).", lower_bound=1)
    flags.DEFINE_string("profile_json", None, "Read this ModelProfile JSON, do not profile.")
    flags.DEFINE_string("topology_json", None, "Read this Topology JSON (ignores --topology).")
    flags.DEFINE_enum("topology", "random", ["homogeneous", "two_level", "random"],
                      "Topology builder.")
    flags.DEFINE_integer("num_devices", 4, "Devices of the built topology.", lower_bound=1)
    flags.DEFINE_integer("devices_per_node", 2, "two_level: devices per node (must divide "
                         "--num_devices).", lower_bound=1)
    flags.DEFINE_float("bandwidth_gbit", 10.0, "homogeneous: every link; random: the fastest "
                       "link (Gbit/s).")
    flags.DEFINE_float("intra_bandwidth_gbit", 100.0, "two_level: links inside a node (Gbit/s).")
    flags.DEFINE_float("inter_bandwidth_gbit", 10.0, "two_level: links across nodes (Gbit/s).")
    flags.DEFINE_float("spread", 0.8, "random: links uniform in [(1 - spread), 1] x "
                       "--bandwidth_gbit.")
    flags.register_validator("spread", lambda v: 0.0 <= v < 1.0, "--spread must be in [0, 1)")
    for name in ("bandwidth_gbit", "intra_bandwidth_gbit", "inter_bandwidth_gbit"):
        flags.register_validator(name, lambda v: v > 0, f"--{name} must be > 0")
    flags.DEFINE_integer("seed", 0, "Seed of the random topology, the model's initialisation "
                         "and the profiled batch.")
    flags.DEFINE_string("out", "plan_pipeline_out", "Output directory (created).")
    for name in ("bandwidth_gbit", "intra_bandwidth_gbit", "inter_bandwidth_gbit"):
        flags.register_validator(name, lambda v: math.isfinite(v) and v > 0,
                                 f"--{name} must be finite and > 0")
    flags.register_validator("spread", lambda v: 0 <= v < 1, "--spread must be in [0, 1)")
    flags.register_validator("input_shape", lambda v: all(s.strip().isdigit() and int(s) > 0
                                                          for s in v),
                             "--input_shape must be positive ints, e.g. 28,28,1")
    flags.register_multi_flags_validator(
        ["topology", "num_devices", "devices_per_node"],
        lambda f: f["topology"] != "two_level" or f["num_devices"] % f["devices_per_node"] == 0,
        "--devices_per_node must divide --num_devices for --topology=two_level")


def profile_registry_model(model: str, input_shape: Sequence[int], num_classes: int,
                           batch_size: int, warmup: int, repeats: int,
                           seed: int) -> ModelProfile:
    """Builds ``model`` and profiles it at ``batch_size`` (inputs [batch_size, *input_shape])."""
    from models.registry import build_model
    from tf_blocksparse.pipeline.profiler import profile_model

    keras_model = build_model(model, tuple(input_shape), num_classes, seed=seed)
    return profile_model(keras_model, tuple(input_shape), batch_size, warmup=warmup,
                         repeats=repeats, allow_non_chain=True, seed=seed)


def build_topology(kind: str, num_devices: int, devices_per_node: int, bandwidth_gbit: float,
                   intra_gbit: float, inter_gbit: float, spread: float,
                   seed: int) -> Topology:
    """A ``homogeneous``, ``two_level`` or ``random`` topology (bandwidths in Gbit/s)."""
    from tf_blocksparse.planning import Topology

    if kind == "homogeneous":
        return Topology.homogeneous(num_devices, bandwidth_gbit * GBIT)
    if kind == "two_level":
        if num_devices % devices_per_node:
            raise ValueError(f"devices_per_node={devices_per_node} must divide "
                             f"num_devices={num_devices}")
        return Topology.two_level(num_devices // devices_per_node, devices_per_node,
                                  intra_gbit * GBIT, inter_gbit * GBIT)
    if kind == "random":
        return Topology.random_heterogeneous(num_devices, bandwidth_gbit * GBIT, spread, seed)
    raise ValueError(f"topology must be homogeneous, two_level or random, got {kind!r}")


def plan_all(profile: ModelProfile, topology: Topology) -> dict[str, PipelinePlan]:
    """The DP's plan and the two baselines', keyed by method."""
    from tf_blocksparse.planning import plan_oblivious, plan_pipedream, plan_pipeline

    plans = (plan_pipeline(profile, topology), plan_pipedream(profile, topology),
             plan_oblivious(profile, topology))
    return {p.method: p for p in plans}


def format_plan(plan: PipelinePlan, profile: ModelProfile) -> str:
    """The plan as a text table: one row per stage, times in ms."""
    names = [lp.name for lp in profile.layers]
    rows = [(str(k), f"{s.first_layer}..{s.last_layer}",
             names[s.first_layer] if s.first_layer == s.last_layer
             else f"{names[s.first_layer]}..{names[s.last_layer]}", ",".join(map(str, s.devices)),
             *(f"{v * MS:.4f}" for v in (s.compute_s, s.comm_in_s, s.sync_s, s.time_s)))
            for k, s in enumerate(plan.stages)]
    head = ("stage", "layers", "names", "devices", "compute_ms", "comm_in_ms", "sync_ms",
            "stage_ms")
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    lines = [f"{plan.method}: {plan.num_stages} stages on {len(plan.devices_used)} devices, "
             f"bottleneck {plan.bottleneck_s * MS:.4f} ms"]
    for r in [head, *rows]:
        lines.append("  ".join(v.ljust(w) if c < 4 else v.rjust(w)
                               for c, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def format_comparison(rows: Sequence[dict]) -> str:
    """One line per method: stages, devices, bottleneck and its ratio to the best."""
    best = min(r["bottleneck_s"] for r in rows)
    return "\n".join(f"{r['method']:<13s} stages {r['stages']:2d}  devices "
                     f"{r['devices_used']:2d}  bottleneck {r['bottleneck_s'] * MS:10.4f} ms  "
                     f"x{r['bottleneck_s'] / best if best > 0 else 1.0:.3f} of the best"
                     for r in rows)


def plot_plans(profile: ModelProfile, topology: Topology, plans: dict[str, PipelinePlan],
               path: str) -> None:
    """Writes a PNG: per plan, a device x layer grid coloured by stage and stage-time bars.

    Rows of a grid are the devices in bandwidth order (highest total first); a stage with
    several rows runs data parallel.  The bars split each stage's time into compute,
    incoming activations and parameter sync; the dashed line is the bottleneck.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    order = topology.bandwidth_order()
    pos = {d: i for i, d in enumerate(order)}
    names = [lp.name for lp in profile.layers]
    fig, axes = plt.subplots(len(plans), 2, figsize=(14, 0.9 + 2.6 * len(plans)),
                             gridspec_kw={"width_ratios": [2, 1]}, squeeze=False)
    for (method, plan), (ax_grid, ax_time) in zip(plans.items(), axes):
        grid = np.full((topology.num_devices, profile.num_layers), np.nan)
        for s, st in enumerate(plan.stages):
            for d in st.devices:
                grid[pos[d], st.first_layer:st.last_layer + 1] = s % 10
                ax_grid.text((st.first_layer + st.last_layer) / 2, pos[d], f"stage {s}",
                             ha="center", va="center", fontsize=7)
        ax_grid.imshow(grid, cmap="tab10", vmin=0, vmax=10, aspect="auto",
                       interpolation="nearest")
        step = max(1, profile.num_layers // 40)
        ticks = list(range(0, profile.num_layers, step))
        ax_grid.set_xticks(ticks, [names[i] for i in ticks], rotation=60, fontsize=7)
        ax_grid.set_yticks(range(topology.num_devices), [f"dev {d}" for d in order],
                           fontsize=7)
        ax_grid.set_title(f"{method}: bottleneck {plan.bottleneck_s * MS:.4f} ms")
        parts = np.array([[st.compute_s, st.comm_in_s, st.sync_s] for st in plan.stages]) * MS
        left = np.zeros(len(parts))
        for c, label in enumerate(("compute", "activations in", "sync")):
            ax_time.barh(range(len(parts)), parts[:, c], left=left,
                         color=["0.3", "C1", "C2"][c], label=label)
            left += parts[:, c]
        ax_time.set_yticks(range(len(parts)), [f"stage {s}" for s in range(len(parts))],
                           fontsize=7)
        ax_time.invert_yaxis()
        ax_time.axvline(plan.bottleneck_s * MS, color="red", linestyle="--")
        ax_time.set_xlabel("ms per micro-batch")
    axes[0, 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _load_json(flag: str, path: str, cls: Any) -> Any:
    """``cls.from_json`` of the file ``--flag`` names; a ``UsageError`` naming the flag."""
    try:
        return cls.from_json(_read(flag, path))
    except (ValueError, KeyError, TypeError) as err:
        raise app.UsageError(f"--{flag}: not a {cls.__name__} JSON: {err}") from err


def _read(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as err:
        raise app.UsageError(f"--{flag}: cannot read {path!r}: {err}") from err


def run(f: Any = FLAGS) -> dict:
    """Reads or builds the topology, profiles (or reads the profile), plans, writes ``--out``.

    Args:
        f: An object with the flags' values as attributes.

    Returns:
        ``{"profile", "topology", "plans", "comparison", "files"}``: the profile, the
        topology, the plans by method, :func:`compare_pipeline_plans`' rows and the paths
        written.
    """
    from tf_blocksparse.planning import ModelProfile, Topology, compare_pipeline_plans

    if f.topology_json:
        topology = _load_json("topology_json", f.topology_json, Topology)
    else:
        topology = build_topology(f.topology, f.num_devices, f.devices_per_node,
                                  f.bandwidth_gbit, f.intra_bandwidth_gbit,
                                  f.inter_bandwidth_gbit, f.spread, f.seed)
    if f.profile_json:
        profile = _load_json("profile_json", f.profile_json, ModelProfile)
    else:
        shape = [int(s) for s in f.input_shape] or list(DATASET_SHAPES[f.dataset])
        profile = profile_registry_model(f.model, shape, f.num_classes, f.batch_size,
                                         f.profile_warmup, f.profile_repeats, f.seed)
    plans = plan_all(profile, topology)
    rows = compare_pipeline_plans(profile, topology, list(plans.values()))
    os.makedirs(f.out, exist_ok=True)
    files = {"plan": "plan.json", "plan_pipedream": "plan_pipedream.json",
             "plan_oblivious": "plan_oblivious.json", "profile": "profile.json",
             "topology": "topology.json", "comparison": "comparison.json",
             "png": "stages.png"}
    files = {k: os.path.join(f.out, v) for k, v in files.items()}
    texts = {"plan": plans["bandwidth_dp"].to_json(),
             "plan_pipedream": plans["pipedream"].to_json(),
             "plan_oblivious": plans["oblivious"].to_json(), "profile": profile.to_json(),
             "topology": topology.to_json(), "comparison": json.dumps(rows, indent=1)}
    for key, text in texts.items():
        with open(files[key], "w", encoding="utf-8") as fh:
            fh.write(text)
    plot_plans(profile, topology, plans, files["png"])
    return {"profile": profile, "topology": topology, "plans": plans, "comparison": rows,
            "files": files}


def main(argv: list[str]) -> None:
    """Runs :func:`run` and prints the profile summary, the plans and the comparison."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tf_blocksparse.planning import pipedream_levels

    result = run()
    profile, topology = result["profile"], result["topology"]
    links = topology.off_diagonal() / GBIT
    print(f"model {profile.name}: {profile.num_layers} layers, compute "
          f"{profile.total_compute_s * MS:.4f} ms per micro-batch, "
          f"{profile.total_param_bytes / 2**20:.3f} MiB of parameters")
    print(f"topology: {topology.num_devices} devices" + (
        f", links {links.min():.2f} .. {links.max():.2f} Gbit/s (mean {links.mean():.2f}), "
        f"bandwidth order {list(topology.bandwidth_order())}" if links.size else ""))
    if topology.num_devices > 1:
        order, levels = pipedream_levels(topology)
        print("PipeDream levels (innermost first): " + ", ".join(
            f"{m} x {bw / GBIT:.2f} Gbit/s" for m, bw in levels) + f"; order {list(order)}")
    for plan in result["plans"].values():
        print()
        print(format_plan(plan, profile))
    print()
    print(format_comparison(result["comparison"]))
    print()
    for key, path in result["files"].items():
        print(f"wrote {key}: {path}")


if __name__ == "__main__":
    script.run(main, define_flags)
