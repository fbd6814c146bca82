"""`bench` stage: the sample-efficiency benchmark, side by side in one run.

Reads every configured training run's `reports/train/<run>/rounds.json` (rounds and wall-clock to
flow_grpo's final reward; definitions in `pipeline.bench`) and times, in this process, a rollout
of the base model against the same raw batched denoiser calls, and rounds of every method side
by side (their cost ratio and each phase's efficiency). Writes
`reports/benchmark.json` and `reports/benchmark.md`, and the headline ratios alone to
`reports/bench_metrics.json` (the DVC metrics).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout
from pipeline.bench import (
    benchmark,
    benchmark_markdown,
    read_training_runs,
    rollout_efficiency,
    round_costs,
    samplers_of,
)
from pipeline.config import Config, ConfigError
from pipeline.io import write_json, write_text
from pipeline.policy import Policy, load_backend
from pipeline.tracking import log_artifact, log_metrics

HEADLINE = ("rounds_ratio", "wallclock_ratio", "round_cost_ratio", "round_nfe_ratio")


@task(name="bench", cache_policy=NO_CACHE)
def bench(cfg: Config) -> dict:
    runs = read_training_runs(cfg.path(layout.REPORTS), cfg.train.methods, cfg.train.seeds)
    try:
        backend, prompts = load_backend(cfg).eval(), layout.training_prompts(cfg)
    except ConfigError as exc:
        result = benchmark(runs)
        result["rollout"], result["rollout_efficiency"] = [], None
        result["notes"].append(f"rollout efficiency and round costs not measured: {exc}")
    else:
        rollout = [
            rollout_efficiency(backend, prompts, cfg, kind, cfg.bench.repeats)
            for kind in samplers_of(cfg)
        ]
        policy = Policy.create(cfg, backend)  # LoRA on: the network the rounds train
        cost = round_costs(policy, prompts, cfg, cfg.train.methods, cfg.bench.round_repeats)
        result = benchmark(runs, round_cost=cost) | {"round_cost": cost, "rollout": rollout}
        # The slowest sampler bounds what any method's rollouts keep of raw throughput.
        result["rollout_efficiency"] = min(r["efficiency"] for r in rollout)
    reports = cfg.path(layout.REPORTS)
    write_json(reports / "benchmark.json", result)
    write_text(reports / "benchmark.md", benchmark_markdown(result))
    # the headline ratios alone are DVC metrics: `dvc metrics show` stays one screen wide
    headline = {key: result[key] for key in HEADLINE} | {
        "rollout_efficiency": result["rollout_efficiency"]
    }
    write_json(reports / "bench_metrics.json", headline)
    flat = {
        f"bench/{key}/{method}": value for key in HEADLINE for method, value in result[key].items()
    } | {"bench/rollout_efficiency": result["rollout_efficiency"]}
    for method, timed in result.get("round_cost", {}).get("methods", {}).items():
        flat |= {f"bench/efficiency/{method}/{p}": v for p, v in timed["efficiency"].items()}
    log_metrics(flat)
    log_artifact(reports / "benchmark.md")
    log_artifact(reports / "benchmark.json")
    return result
