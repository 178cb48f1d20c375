"""`upd info RUN`: what a run file (or a distributed job) holds."""
from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timezone

import click

from ..analyzer.clipping import summarize_clipping
from ..runfile import schema
from ..runfile.opening import open_run
import pandas as pd

from ..safe_text import WIDE_CELL_CHARS, shorten, shorten_all, terminal_safe_data, text_table
from .common import RUN_ARG

# The parameters info lists per optimizer without --wide: a run of 1.1M names printed (and cleaned) every one, 43 s.
# --wide, --json and run.params() list every one.
INFO_PARAM_ROWS = 50

EVENTS_SHOWN = 10  # events listed in the terminal (--json lists them all)

@click.command()
@RUN_ARG
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON (every name whole).")
@click.option("--wide", is_flag=True,
              help=f"List every parameter (default: the first {INFO_PARAM_ROWS} of each optimizer) with every column "
                   "and names up to 200 characters (default: fit 100 columns, long names shortened in the middle "
                   "with '\u2026'; --json holds every name whole).")
def info(run, as_json, wide):
    """Show what RUN holds: optimizers, param groups, parameters with shapes, steps, size.

    For a distributed job's path: its world size, what each rank's file holds (and which steps it lacks), and how
    each parameter is spread over the ranks (sharded, a partition, replicated)."""
    with open_run(run) as r:
        desc = r.describe()
        scalars = r.scalars()
        desc["clipping"] = [dataclasses.asdict(s) | {"text": s.text()} for s in summarize_clipping(scalars)]
        desc["scalars"] = {"names": [c for c in scalars.columns if c not in ("optimizer", "step", "wall_time")],
                           "steps": int(len(scalars))}
        events = r.events()
        desc["events"] = [{"optimizer": int(e.optimizer), "step": int(e.step), "kind": e.kind, "param": e.param,
                           "value": None if e.value is None or e.value != e.value else float(e.value),
                           "wall_time": float(e.wall_time)} for e in events.itertuples()]
    if as_json:
        click.echo(json.dumps(desc, indent=2))  # JSON escapes control characters itself
        return
    desc = shown_safe(desc)  # names, classes, versions, options: the file's text, shown escaped
    created = desc["created_unix"]
    when = datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if created else "?"
    job = desc.get("job")
    kind = "torch-upd run" if job is None else \
        f"torch-upd job of {job['world_size']} processes ({job['parallelism'] or '?'}), {len(job['ranks'])} rank files"
    click.echo(f"{desc['path']}: {kind}, format v{desc['format_version']}, {desc['size_bytes'] / 1e6:.2f} MB"
               + (", being written (this shows the records committed so far)" if desc["live"] else ""))
    rank_of = desc.get(schema.META_DISTRIBUTED)
    if isinstance(rank_of, dict):
        click.echo("  " + distributed_text(rank_of))
    click.echo(f"  recorded {when} with torch {shorten(desc['torch_version'])}, upd {shorten(desc['upd_version'])}")
    if "closed_cleanly" in desc:
        click.echo("  " + lifecycle_text(desc))
    opts = desc["options"]
    click.echo(shorten(f"  options: every={opts.get('every')} stats_every={opts.get('stats_every')} "
               f"what={','.join(map(str, opts.get('what', [])))} "
               f"dtype={opts.get('dtype')} compression={opts.get('compression')}"
               + (f" stats_sample={opts['stats_sample']} (statistics estimated from a sample of that many elements "
                  f"of each larger tensor)" if opts.get("stats_sample") else "")
               + (f" include={opts['include']}" if opts.get("include") else "")
               + (f" exclude={opts['exclude']}" if opts.get("exclude") else ""), 2 * WIDE_CELL_CHARS))
    for rank in job["ranks"] if job else []:
        held = ", ".join(f"optimizer {o['index']}: {o['records']} full-tensor records, {o['stats_steps']} statistics "
                         f"steps" for o in rank["optimizers"])
        lacks = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in rank["lacks_steps"])
        click.echo(f"  rank {rank['rank']}: {os.path.basename(rank['path'])}, {rank['size_bytes'] / 1e6:.2f} MB, {held}"
                   + (f"; lacks steps {lacks} (the job reads the steps every rank holds)" if lacks else ""))
    for opt in desc["optimizers"]:
        span = f"steps {opt['first_step']}..{opt['last_step']}" if opt["records"] else "no steps"
        stats_span = f" (steps {opt['first_recorded_step']}..{opt['last_recorded_step']})" \
            if opt["stats_steps"] and opt.get("first_recorded_step") is not None else ""
        click.echo(f"optimizer {opt['index']}: {shorten(opt['class'])}, {opt['param_groups']} param group(s), "
                   f"{opt['records']} full-tensor records ({span}), {opt['stats_steps']} statistics steps{stats_span}")
        if opt["params"]:
            listed = opt["params"] if wide else opt["params"][:INFO_PARAM_ROWS]
            click.echo(_indent(text_table(param_table(listed), keep=["param", "shape", "rows", "stats rows", "ranks"],
                                          wide=wide)))
            if len(listed) < len(opt["params"]):
                click.echo(f"  ... and {len(opt['params']) - len(listed)} more parameters (--wide or --json lists "
                           "every one; run.params() in Python)")
        if opt.get("frozen"):
            click.echo(f"  frozen (requires_grad=False when recording started; no gradient, no rows): "
                       f"{shorten_all(opt['frozen'])}")
    if desc["scalars"]["steps"]:
        click.echo(f"logged scalars at {desc['scalars']['steps']} steps: {shorten_all(desc['scalars']['names'])} "
                   "(run.scalars(), run.steps())")
    for clipping in desc["clipping"]:
        click.echo(clipping["text"])
    if desc["events"]:
        click.echo(f"events: {len(desc['events'])} live alerts (run.events(); upd analyze ranks them):")
        for e in desc["events"][:EVENTS_SHOWN]:
            value = "" if e["value"] is None else f" ({e['value']:.3g})"
            where = f"optimizer {e['optimizer']} " if e["optimizer"] else ""
            click.echo(f"  {where}step {e['step']}: {e['kind']} {e['param']}{value}")
        if len(desc["events"]) > EVENTS_SHOWN:
            click.echo(f"  ... and {len(desc['events']) - EVENTS_SHOWN} more")
    if desc["params_not_optimized"]:
        click.echo(f"model parameters in no optimizer: {shorten_all(desc['params_not_optimized'])}")


def shown_safe(desc: dict) -> dict:
    """describe()'s text made terminal_safe where info prints it whole; the parameter entries and the frozen and
    scalar names are left as they are: info prints them through text_table and shorten_all, which clean what they
    show (cleaning a 1.1M-name description whole took most of info's time)."""
    listed = {"params", "frozen"}
    out = terminal_safe_data({k: v for k, v in desc.items() if k not in ("optimizers", "scalars", "params_not_optimized")})
    out["scalars"], out["params_not_optimized"] = desc["scalars"], desc["params_not_optimized"]
    out["optimizers"] = [terminal_safe_data({k: v for k, v in opt.items() if k not in listed})
                         | {k: opt[k] for k in listed if k in opt} for opt in desc["optimizers"]]
    return out


def distributed_text(rank_of: dict) -> str:
    """What a rank's file of a distributed job is: the whole job when rank 0 alone recorded (replicated training,
    DDP: the replicas are identical and rank 0 wrote the job's path itself), else that rank's part."""
    job = f"rank {rank_of.get('rank')} of a job of {rank_of.get('world_size')} processes ({rank_of.get('parallelism')})"
    if rank_of.get("recording_ranks") == [0]:
        return (f"{job}, the one rank that recorded: this file is the whole job (replicated training: every rank "
                "held the same parameters and took the same steps)")
    return (f"{job}: this file holds that rank's part; the whole job: upd info "
            f"{shorten(rank_of.get('job_path'), WIDE_CELL_CHARS)}")


def param_table(params: list[dict]) -> pd.DataFrame:
    """One row per parameter of Run.describe()'s optimizer entry, as `upd info` prints it."""
    rows = []
    for p in params:
        row = {"param": p["name"], "shape": "x".join(map(str, p["shape"])) or "scalar", "dtype": p["dtype"] or "?",
               "group": p["group"], "rows": p["rows"], "stats rows": p.get("stats_rows", 0),
               "state": ",".join(p["state"]) or "-"}
        if "layout" in p:
            row["ranks"] = f"{p['layout']} on ranks {','.join(map(str, p['ranks']))}"
        rows.append(row)
    return pd.DataFrame(rows)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def lifecycle_text(desc: dict) -> str:
    """Whether the run was closed by its recorder and how often it was resumed, from ``Run.describe()``."""
    if desc["closed_cleanly"]:
        text = "closed cleanly"
    elif desc["live"]:
        text = "still being written"
    else:
        text = "NOT closed cleanly (the recording process crashed or was killed; every committed record is readable)"
    resumes = desc.get("resumes") or []
    if resumes:
        times = [datetime.fromtimestamp(r["created_unix"], timezone.utc).strftime("%Y-%m-%d %H:%M")
                 for r in resumes if isinstance(r.get("created_unix"), (int, float))]
        text += f"; resumed {len(resumes)} time(s)" + (f" ({', '.join(times)} UTC)" if times else "")
    return text
