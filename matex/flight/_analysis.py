"""Reading the dumps of all ranks and finding where a run went wrong.

Collectives are numbered alike on every rank (each rank's core counts the
collectives it starts), so entry #k of one rank should be entry #k of every
other: the same signature (the agreement check's hash of op, dtype and
shapes). The first #k where signatures differ is the divergence; without one,
the rank whose count is lowest (or that left no dump at all: killed) stopped
first.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional


class FlightError(ValueError):
    """Dumps that cannot be analysed (no directory, no dumps, unreadable dumps)."""


@dataclass
class Finding:
    """What the analysis concluded: ``kind`` is "divergence", "stopped" or "consistent";
    ``ranks`` the ranks it blames, ``seq`` the collective; ``report`` the text printed."""

    kind: str
    ranks: List[int]
    seq: Optional[int]
    report: str
    details: List[str] = field(default_factory=list)


def load(directory) -> List[dict]:
    """Every rank's dump in ``directory`` (of the most recent job when several left dumps)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FlightError("%s is not a directory (the run's MATEX_FLIGHT_DIR; default "
                          "./matex-flight in each rank's working directory)" % directory)
    paths = sorted(directory.glob("rank*.json"))
    if not paths:
        raise FlightError("%s holds no flight dumps (rank<N>.json). Ranks write them on "
                          "SIGUSR1, on a rank failure under --ft, on a stall, or at exit after "
                          "a failed collective; is this the run's MATEX_FLIGHT_DIR?" % directory)
    dumps = []
    for path in paths:
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError) as exc:
            raise FlightError("%s is not a readable flight dump: %s" % (path, exc)) from None
        if not isinstance(record, dict) or not str(record.get("format", "")).startswith(
                "matex-flight/"):
            raise FlightError("%s is not a MaTEx flight dump" % path)
        dumps.append(record)
    latest = max(dumps, key=lambda d: d["time"])["job"]
    return sorted((d for d in dumps if d["job"] == latest), key=lambda d: d["world_rank"])


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank %d" % ranks[0]) if len(ranks) == 1 else (
        "ranks " + ", ".join(map(str, ranks)))


def _what(entry) -> str:
    text = "#%d %s" % (entry["seq"], entry["op"])
    if entry.get("site"):
        text += " (from %s)" % entry["site"]
    return text


def _summary(d) -> str:
    entries = d["entries"]
    last = entries[-1] if entries else None
    main = next(iter(d.get("stacks", {}).values()), {}).get("where", "?")
    return "rank %d (%s, dumped on %s): last collective %s, %s; main thread at %s" % (
        d["world_rank"], d["host"], d["reason"],
        _what(last) if last else "#%d" % d["sequence"],
        last["state"] if last else "-", main)


def analyse(dumps: List[dict]) -> Finding:
    """The first divergence across ranks, else the rank that stopped first."""
    if not dumps:
        raise FlightError("no dumps to analyse")
    size = max(d["world_size"] for d in dumps)
    present = {d["world_rank"] for d in dumps}
    missing = sorted(set(range(size)) - present)
    details = [_summary(d) for d in dumps]
    by_rank = {d["world_rank"]: {e["seq"]: e for e in d["entries"]} for d in dumps}

    # 1. the first collective number at which ranks ran different collectives
    seqs = sorted({s for entries in by_rank.values() for s in entries})
    for seq in seqs:
        groups = {}
        for rank, entries in by_rank.items():
            if seq in entries:
                groups.setdefault(entries[seq]["signature"], []).append(rank)
        if len(groups) > 1:
            ordered = sorted(groups.values(), key=lambda rs: (len(rs), rs))
            blamed = ordered[0] if len(ordered[0]) < len(ordered[-1]) else sorted(
                r for rs in ordered for r in rs)
            parts = ["%s ran %s" % (_ranks(rs), _what(by_rank[rs[0]][seq])) for rs in ordered]
            report = ("ranks diverge at collective #%d: %s. First divergent: %s."
                      % (seq, "; ".join(parts), _ranks(blamed)))
            return Finding("divergence", blamed, seq, _report(report, details, missing), details)

    # 2. ranks that left no dump: they died; say what the survivors were doing
    if missing:
        failed = sorted((e for entries in by_rank.values() for e in entries.values()
                         if e["state"] not in ("ok", "pending")), key=lambda e: e["seq"])
        if failed:
            seq = failed[0]["seq"]
            in_it = sorted(r for r, entries in by_rank.items() if seq in entries)
            report = ("%s stopped first (left no dump: died or was killed): %s failed in "
                      "collective %s (%s)" % (_ranks(missing), _ranks(in_it),
                                              _what(failed[0]), failed[0]["state"]))
        else:
            seq = max((d["sequence"] for d in dumps), default=0)
            report = ("%s stopped first (left no dump: died or was killed); the others "
                      "reached collective #%d" % (_ranks(missing), seq))
        return Finding("stopped", missing, seq, _report(report, details, missing), details)

    # 3. every rank dumped and agrees: the lowest count stopped first
    reached = {d["world_rank"]: d["sequence"] for d in dumps}
    low, high = min(reached.values()), max(reached.values())
    if low < high:
        behind = sorted(r for r, s in reached.items() if s == low)
        ahead = sorted(r for r, s in reached.items() if s == high)
        entry = next((by_rank[r].get(high) for r in ahead if by_rank[r].get(high)), None)
        report = ("%s stopped first: it reached collective #%d, while %s reached %s"
                  % (_ranks(behind), low, _ranks(ahead),
                     _what(entry) if entry else "#%d" % high))
        return Finding("stopped", behind, low + 1, _report(report, details, missing), details)
    report = "no divergence: every rank reached collective #%d" % high
    return Finding("consistent", [], high, _report(report, details, missing), details)


def _report(headline, details, missing) -> str:
    lines = [headline, ""] + details
    lines += ["rank %d: no dump" % r for r in missing]
    return "\n".join(lines)
