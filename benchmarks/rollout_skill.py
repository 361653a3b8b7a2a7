"""Skill of runs side by side, from their ``evaluate.py`` scorecards: RMSE and ACC per channel at chosen leads,
with persistence's and climatology's beside them (the rollout-training and real-weather comparisons of
docs/evaluation.md).

    python benchmarks/rollout_skill.py --runs k1=runs/tiny/1CPU/a_k1,k4=runs/tiny/1CPU/b_k4 --leads 6,24,72,120,240 \
        --out benchmarks/results/cpu_rollout_skill.json

Reads ``<run>/evaluation/scorecard.json`` of each run (``python evaluate.py --run_dir RUN --lead_steps N``
first), prints one table per channel and saves the numbers as JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import read_json, save_json  # noqa: E402
from utils.core.errors import ArgumentParser, UserError, run_cli  # noqa: E402


def parse_runs(text: str) -> dict[str, str]:
    """``--runs`` ``name=run_dir,...`` as {name: run_dir}.

    Raises:
        UserError: an item without ``=``, an empty name or directory, or a name given twice.
    """
    runs = {}
    for item in text.split(","):
        name, _, run = item.partition("=")
        if not (name and run) or name in runs:
            raise UserError(f"--runs item {item!r} is not a new name=run_dir; give e.g. --runs "
                            "k1=runs/tiny/1CPU/a_k1,k4=runs/tiny/1CPU/b_k4")
        runs[name] = run
    return runs


def read_scorecard(run: str) -> dict:
    """``<run>/evaluation/scorecard.json``, checked for what :func:`skill_rows` reads: ``lead_hours``,
    ``channels``, ``initial_times`` and per channel the model's RMSE and ACC and the baselines' scores.

    Raises:
        UserError: missing, unreadable, not JSON or without those fields (evaluate.py writes it).
    """
    path = Path(run) / "evaluation" / "scorecard.json"
    fix = f"run python evaluate.py --run_dir {run} --lead_steps N first"
    card = read_json(path, fix)
    scores = card.get("scores") if isinstance(card, dict) else None
    fine = (isinstance(scores, dict) and isinstance(card.get("lead_hours"), list)
            and isinstance(card.get("channels"), list) and "initial_times" in card
            and all(isinstance(scores.get(k), dict) and isinstance(scores[k].get("rmse"), dict)
                    for k in ("model", "persistence", "climatology"))
            and all(isinstance(scores[k].get("acc"), dict) for k in ("model", "persistence"))
            and all(c in scores[k][m] for c in card["channels"] for k, m in
                    (("model", "rmse"), ("model", "acc"), ("persistence", "rmse"), ("persistence", "acc"),
                     ("climatology", "rmse"))))
    if not fine:
        raise UserError(f"{path} is not an evaluate.py scorecard (it needs lead_hours, channels, initial_times and "
                        f"scores of model, persistence and climatology per channel); {fix}")
    return card


def skill_rows(cards: dict[str, dict], channel: str, leads: list[float]) -> list[dict]:
    """One row per lead (hours) held by every card: each run's RMSE and ACC (of the ensemble mean, for members),
    its CRPS and, with members, its spread/skill ratio (when its scorecard has ensemble scores: docs/ensembles.md),
    persistence's RMSE and ACC and climatology's RMSE (the baselines of the first card: every run is scored on
    the same initial times)."""
    rows = []
    first = next(iter(cards.values()))
    for lead in leads:
        if lead not in first["lead_hours"]:
            continue
        row = {"lead_h": lead}
        for name, card in cards.items():
            j = card["lead_hours"].index(lead)
            row[f"rmse {name}"] = card["scores"]["model"]["rmse"][channel][j]
            row[f"acc {name}"] = card["scores"]["model"]["acc"][channel][j]
            ensemble = card.get("ensemble")
            if ensemble:
                row[f"crps {name}"] = ensemble["crps"][channel][j]
                if card.get("members", 1) > 1:
                    row[f"spread_skill {name}"] = ensemble["spread_skill"][channel][j]
        j = first["lead_hours"].index(lead)
        for baseline in ("persistence", "climatology"):
            row[f"rmse {baseline}"] = first["scores"][baseline]["rmse"][channel][j]
        row["acc persistence"] = first["scores"]["persistence"]["acc"][channel][j]
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="comma list of name=run_dir")
    ap.add_argument("--leads", default="6,24,48,72,120,168,240", help="lead times in hours")
    ap.add_argument("--out", default="benchmarks/results/rollout_skill.json")
    args = ap.parse_args(argv)
    runs = parse_runs(args.runs)
    cards = {name: read_scorecard(run) for name, run in runs.items()}
    first = next(iter(cards.values()))["channels"]
    for name, card in cards.items():
        if not set(first) <= set(card["channels"]):
            raise UserError(f"run {name} ({runs[name]}) has no scores of {sorted(set(first) - set(card['channels']))} "
                            "that the first run has; evaluate every run on the same channels")
    leads = [float(v) for v in args.leads.split(",")]
    result = {"runs": {name: {"dir": runs[name], "training_rollout": card.get("training_rollout"),
                              "inputs": card.get("inputs"), "members": card.get("members", 1),
                              "checkpoint_step": card.get("checkpoint_step"), "initial_times": card["initial_times"]}
                       for name, card in cards.items()}, "channels": {}}
    for name, info in result["runs"].items():
        print(f"{name}: {info['dir']} at step {info['checkpoint_step']}, {info['training_rollout']}, "
              f"{info['initial_times']} initial times")
    for channel in next(iter(cards.values()))["channels"]:
        rows = skill_rows(cards, channel, leads)
        result["channels"][channel] = rows
        keys = list(rows[0])
        print(f"\n{channel}\n" + "  ".join(f"{k:>16}" for k in keys))
        for row in rows:
            print("  ".join(f"{row[k]:>16.4g}" for k in keys))
    save_json(Path(args.out), result)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
