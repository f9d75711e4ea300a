"""The command line both training recipes share: ``train`` (under torchrun) and ``compare`` (the closing table).

    parser, train_parser = parser_for("description", defaults="30 steps on CPU", batch_default="2")
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sp_recipes.report import closing_table, write_plot

__all__ = ["compare", "load_run", "parser_for"]


def load_run(path: str) -> dict[str, Any]:
    """A ``run.json``, with a clear error where it is missing or not a run record."""
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"compare: cannot read the run record {path} ({type(exc).__name__}: {exc}); pass the "
                         "run.json a training run wrote under its --out-dir") from exc
    missing = [k for k in ("switch", "backend", "steps") if k not in run]
    if missing or not run["steps"]:
        raise SystemExit(f"compare: {path} is not a run record with steps (missing {missing or ['steps']})")
    run["path"] = path
    return run


class _Positive(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None and values < self.const:
            parser.error(f"{option_string}={values}: must be >= {self.const}")
        setattr(namespace, self.dest, values)


def parser_for(description: str, *, defaults: str, batch_default: str, config_choices: list[str] | None = None
               ) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``train`` / ``compare`` parser and its ``train`` subparser (for a recipe's own options); counts below
    their minimum are refused naming the flag."""
    parser = argparse.ArgumentParser(description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="one training run (under torchrun)")
    t.add_argument("--out-dir", required=True, help="run.json and checkpoints/ go here")
    if config_choices:
        t.add_argument("--config", choices=config_choices, help="model preset (default: tiny on CPU, small on CUDA)")
    t.add_argument("--steps", type=int, action=_Positive, const=1, help=f"last step (default: {defaults})")
    t.add_argument("--batch", type=int, action=_Positive, const=1, help=f"per DP rank and step ({batch_default})")
    t.add_argument("--sp", type=int, action=_Positive, const=1, help="SP size (default: every rank)")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup-steps", type=int, action=_Positive, const=1, default=5,
                   help="learning-rate warm-up steps (linear)")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ckpt-every", type=int, action=_Positive, const=1,
                   help="checkpoint every N steps (default: half the steps) and at the end")
    t.add_argument("--resume", help="a checkpoint to continue from (its step is the last one done)")
    c = sub.add_parser("compare", help="the closing table of runs; asserts equal losses")
    c.add_argument("runs", nargs="+", help="run.json files; the first is the reference")
    c.add_argument("--resumed", help="a run.json of a resumed run, checked against the run of its switch")
    c.add_argument("--plot", help="write the loss / step-time PNG here")
    c.add_argument("--table", help="also write the table, as printed, to this file (the job's own lines only: "
                   "stdout may carry the model library's log lines)")
    c.add_argument("--warmup", type=int, action=_Positive, const=0, default=1,
                   help="steps at the start of each run left out of the timings and the time axis (default 1)")
    return parser, t


def compare(args: argparse.Namespace) -> int:
    """``compare``: the closing table of ``args.runs`` (and ``args.resumed``), then the plot; 1 if losses differ."""
    runs = [load_run(p) for p in args.runs]
    resumed = load_run(args.resumed) if args.resumed else None
    lines, ok = closing_table(runs, resumed=resumed, warmup=args.warmup)
    if args.plot:
        lines.insert(-1, write_plot([*runs, *([resumed] if resumed else [])], Path(args.plot), warmup=args.warmup))
    print("\n".join(lines))
    if args.table:
        Path(args.table).write_text("\n".join(lines) + "\n")
    return 0 if ok else 1
