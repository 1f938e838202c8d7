"""Replay benchmark of the autoconfig searchers on the committed profile bank (measured on real deployments).

    .venv/bin/python -m benchmarks.bench_autoconfig [--seeds 10] [--bank benchmarks/results/autoconfig_bank_v2]
        [--second-bank benchmarks/results/autoconfig_bank_v2_second]

Leave-one-model-out: every searcher runs on every profiled model's recorded surface with the other models as its
prior (the meta-learned searcher trains on those over the same knobs), for ``--seeds`` seeds each; a model alone
over its knobs has nothing to learn from and is listed as not replayed (its surface facts and gain still count).
Reported: trials to reach within 5% of the model's optimum, within its measurement noise, and the optimum
(median / p90 / mean over models x seeds), the median as a fraction of the space, and how many times fewer trials
the meta searcher needs than each baseline (ratio of medians). Baselines: random, TPE, GP, and those that learn from the
bank too: best-on-average (no learning), prior-only (the meta-learned prior, never adapted) and TPE warm-started
with the other models' best trials. ``summary`` (issue 21): ``meta_median_trials_to_optimum``,
``meta_median_fraction_of_space`` (goal <= 0.05), ``best_baseline_median_trials`` (best of best-on-average, prior-
only, tpe-warm, TPE, GP) and ``ratio_best_baseline_to_meta`` (goal >= 2); the same for ``rgpe`` (a GP ensemble
with expected improvement, its models first weighted by how alike their descriptions are, its GPs smoothed by the
bank's measurement noise), with its ablation (``rgpe-noiseless``, ``rgpe-no-context``, ``rgpe-late``); meta and
prior-only without their opening (``*-no-opening``: the surrogate's best first, not the most frequent optimum);
and the same goals counted to within each model's measurement noise of its optimum (``*_within_noise``). Issue
48's: ``median_gain_over_shipped`` (goal >= 1.5: each model's optimum over its app as shipped, the entry's
``starting`` measurement) and ``median_minutes_to_within_5pct`` (the meta searcher's recorded trial time until it
first holds a configuration within 5% of the optimum), with how many models recorded each (``models_with_*``).

How far a measured optimum can be found at all (``autoconfig.reproducibility``): how often two runs of an entry's
repeated configurations name the same one best, against chance; the noise floor (``noise_floor_*``): the trials to
the optimum of profiles simulated with each model's measurement noise, in the order of its own recorded surface,
the floor under a searcher that knew the model's surface exactly; for the models profiled a second time
(``--second-bank``), the trials to one profile's optimum in the order of the other (``same_model_*``), the floor
under what learning from other models can reach; and the trials in the one fixed order best in hindsight (the
configurations by how many of the bank's optima they are), the floor under any ranking that ignores the trials.
Writes ``<--out>/bench_autoconfig.{json,md,png}`` (``benchmarks/results`` by default).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console

from autoconfig.bank import BankEntry, load_bank
from autoconfig.evaluate import plot_progress, replay_table
from autoconfig.replay import replay
from autoconfig.reproducibility import (
    best_agreement,
    hindsight_order_trials,
    noise_floor_trials,
    optimum_index,
    same_model_trials,
    surface_rank_correlation,
)
from autoconfig.searchers import SEARCHERS, MetaParams, RGPESearcher, SearcherFactory, meta_factory
from benchmarks.records import REPO, RESULTS, provenance

BASELINES = ("random", "tpe", "gp", "best-on-average", "prior-only", "tpe-warm")
#: RGPE with its parts taken out (the ablation): without measurement noise in its GPs, without the likeness of
#: model descriptions, and also ranking only from the fifth trial.
ABLATIONS: dict[str, SearcherFactory] = {
    "rgpe-noiseless": lambda space, seed, prior, target=None: RGPESearcher(space, seed, prior, target=target,
                                                                           noise_aware=False),
    "rgpe-no-context": lambda space, seed, prior, target=None: RGPESearcher(space, seed, prior),
    "rgpe-late": lambda space, seed, prior, target=None: RGPESearcher(space, seed, prior, rank_from=5),
    # Meta and its prior-only ranking opening with the surrogate's best instead of the bank's most frequent optimum.
    "meta-no-opening": meta_factory(MetaParams(opening=False)),
    "prior-only-no-opening": meta_factory(MetaParams(opening=False), adapt=False),
}
#: The baselines the meta searcher must beat (issue 21): the best of these is ``best_baseline_median_trials``.
STRONG_BASELINES = ("best-on-average", "prior-only", "tpe-warm", "tpe", "gp")


def surface_facts(entries) -> list[dict[str, object]]:
    """Per model: size, feasible share, optimum, how many configurations lie within 5% of it, the measurement
    noise of its entry (median std/mean of its repeated configurations; None without repeats) and the swiftserve
    commits that measured it (None: a measurement that did not record one)."""
    facts = []
    for entry in entries:
        configs, values = entry.surface()
        best = int(np.nanargmax(values))
        feasible = np.nan_to_num(values, nan=0.0)
        facts.append({
            "model": entry.name, "configurations": entry.space.size,
            "feasible": int(np.isfinite(values).sum()),
            "within_5pct": int((feasible >= 0.95 * values[best]).sum()),
            "optimum": configs[best].as_dict(), "optimum_objective": float(values[best]),
            "noise": entry.noise(), "code": entry.code_versions(),
            "machines": entry.machines(), "most_lost": entry.most_lost(),
            "gain_over_shipped": entry.gain_over_starting(),
        })
    return facts


def tuning_gains(entries: list[BankEntry], meta_minutes: dict[str, np.ndarray]) -> dict[str, object]:
    """What tuning buys and costs: each model's optimum over its app as shipped (entries that recorded it) and the
    meta searcher's minutes of recorded trial time to within the tolerance (``meta_minutes`` by model: those
    replayed that recorded durations), medians overall and per family (None where no entry recorded it)."""
    def median(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    gains = {entry.name: entry.gain_over_starting() for entry in entries}
    minutes = {entry.name: [float(m) for m in meta_minutes.get(entry.name, ()) if np.isfinite(m)]
               for entry in entries}

    def of(names: list[str]) -> dict[str, float | int | None]:
        recorded = [gains[name] for name in names if gains[name] is not None]
        timed = [m for name in names for m in minutes[name]]
        return {"median_gain_over_shipped": median(recorded), "models_with_shipped": len(recorded),
                "median_minutes_to_within_5pct": median(timed),
                "models_with_durations": sum(bool(minutes[name]) for name in names)}

    families = {family: of([entry.name for entry in entries if entry_family(entry) == family])
                for family in sorted({entry_family(entry) for entry in entries})}
    return {**of(list(gains)), "families": families}


def gain_lines(gains: dict[str, object]) -> list[str]:
    """The gain over the shipped configuration and the minutes to within 5%, overall and per family."""
    def figure(value: float | None, unit: str) -> str:
        return "not recorded" if value is None else f"{value:.2f}{unit}"

    lines = [f"Optimum over the app's shipped configuration, median: {figure(gains['median_gain_over_shipped'], 'x')} "
             f"over {gains['models_with_shipped']} model(s) that recorded it (goal >= 1.5x); meta searcher's "
             f"recorded trial time to within 5% of the optimum, median: "
             f"{figure(gains['median_minutes_to_within_5pct'], ' min')} over {gains['models_with_durations']} "
             "model(s) that recorded durations.", ""]
    for family, figures in gains["families"].items():
        lines.append(f"- {family}: {figure(figures['median_gain_over_shipped'], 'x')} "
                     f"({figures['models_with_shipped']} model(s)), "
                     f"{figure(figures['median_minutes_to_within_5pct'], ' min')} "
                     f"({figures['models_with_durations']} model(s))")
    return [*lines, ""]


def entry_family(entry: BankEntry) -> str:
    """A bank model's family by its knobs: diffusion spaces search torch threads, DLRM's do not."""
    return "diffusion" if "torch_threads" in entry.space.knob_names else "dlrm"


def replayable(entries: list[BankEntry]) -> tuple[list[BankEntry], list[BankEntry]]:
    """The entries that another entry of the same knobs can be a prior for (leave-one-out replays them), and
    those alone in their family, which no searcher that learns from the bank can be replayed on."""
    knobs = Counter(entry.space.knob_names for entry in entries)
    return ([entry for entry in entries if knobs[entry.space.knob_names] > 1],
            [entry for entry in entries if knobs[entry.space.knob_names] == 1])


def short_code(code: str | None) -> str:
    """A commit as its first 7 hex digits (``-dirty`` kept), another version as it is; None as not recorded."""
    if code is None:
        return "not recorded"
    commit, dirty, rest = code.partition("-dirty")
    return commit[:7] + dirty if re.fullmatch(r"[0-9a-f]{40}", commit) and not rest else code


def reproducibility(entries: list[BankEntry], second: list[BankEntry]) -> dict[str, object]:
    """Per model: how often its repeats agree on the best (and chance), and, where it was profiled twice, the
    trials to each profile's optimum in the other's order and the two surfaces' rank correlation."""
    seconds = {entry.name: entry for entry in second}
    models = []
    floors = []
    for entry in entries:
        row: dict[str, object] = {"model": entry.name, "agreement": None, "chance": None, "noise_floor": None}
        if (agreement := best_agreement(entry)) is not None:
            row["agreement"], row["chance"] = agreement
        if (floor := noise_floor_trials(entry)) is not None:
            row["noise_floor"] = {"median": float(np.median(floor)), "mean": float(floor.mean()),
                                  "at_first_trial": float(np.mean(floor == 1))}
            floors.append(floor)
        if (other := seconds.get(entry.name)) is not None:
            row["trials_first_to_second"] = same_model_trials(entry, other)
            row["trials_second_to_first"] = same_model_trials(other, entry)
            row["rank_correlation"] = surface_rank_correlation(entry, other)
            row["optima"] = [entry.space.configurations()[optimum_index(e)].as_dict() for e in (entry, other)]
        models.append(row)
    agreements = [row for row in models if row["agreement"] is not None]
    twice = [row for row in models if "rank_correlation" in row]
    same_model = [row[key] for row in twice for key in ("trials_first_to_second", "trials_second_to_first")]
    by_space: dict[tuple, list[int]] = {}  # a fixed order ranks the configurations of one space
    for index, entry in enumerate(entries):
        by_space.setdefault(entry.space.configurations(), []).append(index)
    hindsight = [0] * len(entries)
    for indices in by_space.values():
        for index, trials in zip(indices, hindsight_order_trials([entries[i] for i in indices]), strict=True):
            hindsight[index] = trials
    pooled = np.concatenate(floors) if floors else None
    for row, trials in zip(models, hindsight, strict=True):
        row["hindsight_order_trials"] = trials
    return {
        "models": models,
        "hindsight_order_median_trials": float(np.median(hindsight)),
        "distinct_optima": len({optimum_index(entry) for entry in entries}),
        "mean_agreement": float(np.mean([row["agreement"] for row in agreements])) if agreements else None,
        "mean_chance": float(np.mean([row["chance"] for row in agreements])) if agreements else None,
        "profiled_twice": len(twice),
        "same_model_trials": same_model,
        "same_model_median_trials": float(np.median(same_model)) if same_model else None,
        "noise_floor_median_trials": float(np.median(pooled)) if floors else None,
        "noise_floor_mean_trials": float(np.mean(pooled)) if floors else None,
    }


def floor_text(facts: dict[str, object]) -> str:
    """The floors under the trials to the optimum (median), as the goals' line states them beside the goals."""
    def trials(value: float | None) -> str:
        return "not measured" if value is None else f"{value:.1f} trials"

    return (f"the same model profiled twice {trials(facts['same_model_median_trials'])}, the noise floor "
            f"{trials(facts['noise_floor_median_trials'])}, the best fixed order "
            f"{trials(facts['hindsight_order_median_trials'])}")


def reproducibility_lines(facts: dict[str, object]) -> list[str]:
    lines = ["How reproducible the optimum is: of each model's repeated configurations (its best, raced until the "
             "three best by mean had three runs each), how often the two runs after the first (which picked them) "
             "name the same one best; where the model was profiled a second time, the trials to each profile's "
             "optimum in the order the other measured the configurations (first to second, second to first) and the "
             "two surfaces' rank correlation. The noise floor: over 2000 profiles simulated with the model's "
             "measurement noise (each configuration's objective times a lognormal factor of mean 1 and its entry's "
             "noise, over the root of its runs where raced), the trials to each one's optimum in the order of the "
             "recorded surface, the floor under a searcher that knew the model's surface exactly (median, mean, and "
             "how often 1 trial is enough).", "",
             "| model | repeat runs agreeing on the best | chance | noise floor: median | mean | at trial 1 | "
             "trials, first's order to second's optimum | second's to first's | rank correlation |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in facts["models"]:
        floor = row["noise_floor"]
        cells = [row["model"], "-" if row["agreement"] is None else f"{row['agreement']:.2f}",
                 "-" if row["chance"] is None else f"{row['chance']:.2f}",
                 *(["-"] * 3 if floor is None else [f"{floor['median']:.1f}", f"{floor['mean']:.2f}",
                                                    f"{floor['at_first_trial']:.0%}"])]
        if "rank_correlation" in row:
            cells += [str(row["trials_first_to_second"]), str(row["trials_second_to_first"]),
                      f"{row['rank_correlation']:.2f}"]
        else:
            cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"The {len(facts['models'])} optima lie on {facts['distinct_optima']} distinct configurations: "
                 f"even the fixed order best in hindsight (configurations by how many models' optimum they are, the "
                 f"held-out model's included) needs {facts['hindsight_order_median_trials']:.1f} trials (median); "
                 "a searcher under that must learn which optimum from the trials themselves.")
    if facts["mean_agreement"] is not None:
        lines.append(f"Repeat runs agree on the best repeated configuration in {facts['mean_agreement']:.0%} of pairs "
                     f"(chance {facts['mean_chance']:.0%}).")
    if facts["noise_floor_median_trials"] is not None:
        lines.append(f"A searcher that knew each model's surface exactly would need "
                     f"{facts['noise_floor_median_trials']:.1f} trials (median; mean "
                     f"{facts['noise_floor_mean_trials']:.2f}) to the optimum of a profile measured with the model's "
                     "noise: no searcher is expected under that.")
    if facts["same_model_median_trials"] is not None:
        lines.append(f"A searcher that knew another full profile of the very model needs "
                     f"{facts['same_model_median_trials']:.1f} trials (median of {len(facts['same_model_trials'])} "
                     f"orders over {facts['profiled_twice']} models profiled twice) to this profile's optimum.")
    return [*lines, ""]


def family_medians(entries, result) -> dict[str, dict]:
    """Per family of models (same knobs: DLRM, diffusion), each searcher's median and mean trials to within the
    tolerance over that family's models x seeds."""
    families: dict[str, list[int]] = {}
    for index, entry in enumerate(entries):
        families.setdefault(entry_family(entry), []).append(index)
    table = {}
    for family, rows in families.items():
        table[family] = {"models": len(rows), "space": int(np.median([entries[i].space.size for i in rows]))}
        for name, report in result.searchers.items():
            counts = report.trials_to_within[rows].ravel()
            table[family][name] = (float(np.median(counts)), float(np.mean(counts)))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bank", default=str((RESULTS / "autoconfig_bank_v2").relative_to(REPO)))
    parser.add_argument("--second-bank", default=str((RESULTS / "autoconfig_bank_v2_second").relative_to(REPO)),
                        help="second profiles of some of the bank's models (skipped when the folder is missing)")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")
    args = parser.parse_args()
    source = provenance()  # before this run writes its own results into the tree
    console = Console()
    bank = load_bank(REPO / args.bank)
    entries, alone = replayable(bank)
    not_replayed = (f"Not replayed, no other model over the same knobs to learn from: "
                    f"{', '.join(entry.name for entry in alone)}.")
    if alone:
        console.print(not_replayed)
    second = load_bank(REPO / args.second_bank) if (REPO / args.second_bank).is_dir() else []
    names = ["meta", "rgpe", *ABLATIONS, *BASELINES]
    started = time.monotonic()
    result = replay({name: ABLATIONS.get(name) or SEARCHERS[name] for name in names}, entries, seeds=range(args.seeds),
                    tolerance=args.tolerance)
    elapsed = time.monotonic() - started
    console.print(replay_table(result))
    sizes = np.array(result.space_sizes, dtype=np.float64)[:, None]
    # An optimum measured with noise n is not told apart from configurations within n of it: the trials to there.
    noise_tolerances = [entry.noise() or args.tolerance for entry in entries]
    summary = {}
    for name, report in result.searchers.items():
        stats = report.summary()
        stats["within_median_fraction_of_space"] = float(np.median(report.trials_to_within / sizes))
        within_noise = result.trials_to_within(name, noise_tolerances)
        stats["within_noise_median"], stats["within_noise_mean"] = (float(np.median(within_noise)),
                                                                    float(np.mean(within_noise)))
        summary[name] = stats
    meta = summary["meta"]["within_median"]
    ratios = {name: summary[name]["within_median"] / meta for name in BASELINES}
    best_baseline = min(STRONG_BASELINES, key=lambda name: summary[name]["optimum_median"])
    best_in_noise = min(STRONG_BASELINES, key=lambda name: summary[name]["within_noise_median"])
    repro = reproducibility(entries, second)  # the floors beside the goals: of the models replayed
    goals = {
        "meta_median_trials_to_optimum": summary["meta"]["optimum_median"],
        "meta_median_fraction_of_space": float(np.median(result.searchers["meta"].trials_to_optimum / sizes)),
        "best_baseline": best_baseline,
        "best_baseline_median_trials": summary[best_baseline]["optimum_median"],
        "ratio_best_baseline_to_meta": summary[best_baseline]["optimum_median"] / summary["meta"]["optimum_median"],
        "rgpe_median_trials_to_optimum": summary["rgpe"]["optimum_median"],
        "rgpe_mean_trials_to_optimum": summary["rgpe"]["optimum_mean"],
        "meta_mean_trials_to_optimum": summary["meta"]["optimum_mean"],
        "best_baseline_mean_trials": summary[best_baseline]["optimum_mean"],
        "meta_median_trials_within_noise": summary["meta"]["within_noise_median"],
        "meta_median_fraction_of_space_within_noise": float(np.median(
            result.trials_to_within("meta", noise_tolerances) / sizes)),
        "best_baseline_within_noise": best_in_noise,
        "best_baseline_median_trials_within_noise": summary[best_in_noise]["within_noise_median"],
        "ratio_best_baseline_to_meta_within_noise": (summary[best_in_noise]["within_noise_median"]
                                                     / summary["meta"]["within_noise_median"]),
        "rgpe_median_trials_within_noise": summary["rgpe"]["within_noise_median"],
        "optimum_repeat_agreement": repro["mean_agreement"],
        "optimum_repeat_agreement_chance": repro["mean_chance"],
        "same_model_median_trials_to_optimum": repro["same_model_median_trials"],
        "hindsight_order_median_trials_to_optimum": repro["hindsight_order_median_trials"],
        "noise_floor_median_trials_to_optimum": repro["noise_floor_median_trials"],
        "noise_floor_mean_trials_to_optimum": repro["noise_floor_mean_trials"],
    }
    gains = tuning_gains(bank, dict(zip(result.models, result.searchers["meta"].minutes_to_within(), strict=True)))
    goals |= {key: gains[key] for key in ("median_gain_over_shipped", "models_with_shipped",
                                          "median_minutes_to_within_5pct", "models_with_durations")}
    families = family_medians(entries, result)
    facts = surface_facts(bank)
    lines = [
        f"# autoconfig replay on the measured profile bank ({len(bank)} models, {len(entries)} replayed, "
        f"{args.seeds} seeds, leave-one-model-out)", "",
        *([not_replayed, ""] if alone else []),
        "| model | configurations | feasible | within 5% of optimum | optimum | objective | noise | measured at | "
        "measured on | most CPU lost to other work | optimum / shipped config |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {f['model']} | {f['configurations']} | {f['feasible']} | {f['within_5pct']} | {f['optimum']} | "
          f"{f['optimum_objective']:.1f} | {'-' if f['noise'] is None else format(f['noise'], '.1%')} | "
          f"{', '.join(map(short_code, f['code']))} | "
          f"{', '.join(machine or 'not recorded' for machine in f['machines'])} | "
          f"{'not recorded' if f['most_lost'] is None else format(f['most_lost'], '.0%')} | "
          f"{'not recorded' if f['gain_over_shipped'] is None else format(f['gain_over_shipped'], '.2f') + 'x'} |"
          for f in facts), "",
        *gain_lines(gains),
        "| searcher | within 5%: median | p90 | mean | median / space | to optimum: median | p90 | mean | "
        "within the noise: median | mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {name} | {s['within_median']:.1f} | {s['within_p90']:.1f} | {s['within_mean']:.1f} | "
          f"{100 * s['within_median_fraction_of_space']:.1f}% | {s['optimum_median']:.1f} | {s['optimum_p90']:.1f} | "
          f"{s['optimum_mean']:.1f} | {s['within_noise_median']:.1f} | {s['within_noise_mean']:.1f} |"
          for name, s in summary.items()), "",
        "Within the noise: to a best within the model's measurement noise of its optimum (the median std/mean of "
        f"its repeated configurations; {args.tolerance:.0%} for a model without repeats), where one measurement "
        "no longer tells a configuration from the optimum.", "",
        "Trials to within 5%, median, baseline / meta: "
        + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()), "",
        f"Trials to the optimum, median: meta {goals['meta_median_trials_to_optimum']:.1f} "
        f"({100 * goals['meta_median_fraction_of_space']:.1f}% of the space; goal <= 5%); best baseline "
        f"{best_baseline} {goals['best_baseline_median_trials']:.1f}, "
        f"{goals['ratio_best_baseline_to_meta']:.2f}x meta's (goal >= 2x). The bank's floors beside them: "
        f"{floor_text(repro)}.", "",
        f"Trials to within the noise, median: meta {goals['meta_median_trials_within_noise']:.1f} "
        f"({100 * goals['meta_median_fraction_of_space_within_noise']:.1f}% of the space); best baseline "
        f"{best_in_noise} {goals['best_baseline_median_trials_within_noise']:.1f}, "
        f"{goals['ratio_best_baseline_to_meta_within_noise']:.2f}x meta's; rgpe "
        f"{goals['rgpe_median_trials_within_noise']:.1f}.", "",
        *reproducibility_lines(repro),
        "Per family (models over the same knobs; the meta searcher learns only from its own family):", "",
        "| family | models | " + " | ".join(f"{name}: median (mean)" for name in names) + " | meta, % of space |",
        "|---|---|" + "---|" * len(names) + "---|",
        *(f"| {family} | {f['models']} | " + " | ".join(f"{f[name][0]:.1f} ({f[name][1]:.1f})" for name in names)
          + f" | {100 * f['meta'][0] / f['space']:.1f}% |" for family, f in families.items()), "",
        f"Command: `.venv/bin/python -m benchmarks.bench_autoconfig --seeds {args.seeds} --bank {args.bank} "
        f"--second-bank {args.second_bank}` ({elapsed:.0f} s).",
    ]
    table = "\n".join(lines)
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_progress(result, args.out / "bench_autoconfig.png", trials=40)
    payload = {**source, "summary": goals, "bank": args.bank, "second_bank": args.second_bank,
               "reproducibility": repro, "seeds": args.seeds,
               "tolerance": args.tolerance, "models": facts,
               "families": families, "tuning_gains": gains,
               "machine": entries[0].machine if entries else {}, "searchers": summary,
               "not_replayed": [entry.name for entry in alone],
               "within_ratio_vs_meta": ratios, "seconds": elapsed,
               "per_run": {name: {"trials_to_within": report.trials_to_within.tolist(),
                                  "trials_to_optimum": report.trials_to_optimum.tolist()}
                           for name, report in result.searchers.items()}}
    (args.out / "bench_autoconfig.md").write_text(table + "\n")
    (args.out / "bench_autoconfig.json").write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"wrote {args.out / 'bench_autoconfig.md'}, .json and {plot}")


if __name__ == "__main__":
    main()
