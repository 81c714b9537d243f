"""Reading the dumps of all ranks and finding where a run went wrong.

Each communicator has its own order of collectives: its members count the
collectives they start on it (``comm_seq``), and every entry names its
communicator (``comm``: an id its members agree on). Entry #k of a
communicator on one member should be entry #k on every other member: the
same signature (the agreement check's hash of op, dtype and shapes). Numbers
on different communicators never compare (a search group's or a grid
group's collectives are not the world's). The first #k where signatures
differ is the divergence; without one, the member of a communicator whose
count on it is lowest (or a rank that left no dump at all: killed) stopped
first.
"""

import json
import os
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
    comm: Optional[str] = None   # the communicator ``seq`` counts on (its id)


def load(directory: str | os.PathLike) -> List[dict]:
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


def _span(ranks) -> str:
    """``0-3, 6`` for ranks 0, 1, 2, 3, 6 (``0, 1`` for 0, 1)."""
    ranks, parts = sorted(ranks), []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    return ", ".join(str(a) if a == b else ("%d, %d" if b == a + 1 else "%d-%d") % (a, b)
                     for a, b in parts)


def comm_label(members, world_size=None) -> str:
    """A communicator for people: ``all 3 ranks`` or ``ranks 0, 1`` (world ranks)."""
    members = sorted(members or [])
    if not members:
        return "an unknown communicator"
    if world_size and members == list(range(world_size)):
        return "the communicator of all %d ranks" % world_size
    return "the communicator of rank%s %s" % ("s" if len(members) > 1 else "", _span(members))


def comm_of(entry) -> str:
    """The communicator an entry ran on (dumps before ``matex-flight/2``: one, "")."""
    return entry.get("comm", "")


def number(entry) -> int:
    """The entry's number on its communicator (0: point-to-point, not in that order)."""
    return entry.get("comm_seq", entry["seq"])


def comms_of(d) -> dict:
    """comm id -> that communicator's record (members, seq, pending) in dump ``d``."""
    if "comms" in d:
        return {c["comm"]: c for c in d["comms"]}
    return {"": {"comm": "", "members": list(range(d["world_size"])), "seq": d["sequence"],
                 "pending_seq": d["sequence"] if d.get("pending_since") else 0,
                 "pending_since": d.get("pending_since", 0), "current": True}}


def _what(entry) -> str:
    text = "#%d %s" % (number(entry), entry["op"])
    if entry.get("site"):
        text += " (from %s)" % entry["site"]
    return text


def _summary(d, labels) -> str:
    entries = d["entries"]
    last = entries[-1] if entries else None
    main = next(iter(d.get("stacks", {}).values()), {}).get("where", "?")
    if last:
        what = "%s on %s, %s" % (_what(last), labels.get(comm_of(last), "?"), last["state"])
    else:
        what = "#%d, -" % d["sequence"]
    return "rank %d (%s, dumped on %s): last collective %s; main thread at %s" % (
        d["world_rank"], d["host"], d["reason"], what, main)


def analyse(dumps: List[dict]) -> Finding:
    """The first divergence across ranks, else the rank that stopped first."""
    if not dumps:
        raise FlightError("no dumps to analyse")
    size = max(d["world_size"] for d in dumps)
    present = {d["world_rank"] for d in dumps}
    missing = sorted(set(range(size)) - present)
    comms = {r: comms_of(d) for r, d in ((d["world_rank"], d) for d in dumps)}
    members = {}
    for table in comms.values():
        for cid, c in table.items():
            members.setdefault(cid, sorted(c.get("members") or []))
    labels = {cid: comm_label(m, size) for cid, m in members.items()}
    details = [_summary(d, labels) for d in dumps]
    # rank -> (comm, number on it) -> entry; point-to-point entries are not in any order
    by_rank = {d["world_rank"]: {(comm_of(e), number(e)): e for e in d["entries"]
                                 if number(e) > 0} for d in dumps}

    def label(cid):
        return labels.get(cid, "communicator %s" % (cid or "?"))

    # 1. the first collective (of some communicator) at which its members ran different ones
    first_start = {}
    for entries in by_rank.values():
        for key, e in entries.items():
            first_start[key] = min(first_start.get(key, e["start"] or float("inf")),
                                   e["start"] or float("inf"))
    for key in sorted(first_start, key=lambda k: (first_start[k], k)):
        groups = {}
        for rank, entries in by_rank.items():
            if key in entries:
                groups.setdefault(entries[key]["signature"], []).append(rank)
        if len(groups) > 1:
            ordered = sorted(groups.values(), key=lambda rs: (len(rs), rs))
            blamed = ordered[0] if len(ordered[0]) < len(ordered[-1]) else sorted(
                r for rs in ordered for r in rs)
            parts = ["%s ran %s" % (_ranks(rs), _what(by_rank[rs[0]][key])) for rs in ordered]
            report = ("ranks diverge at collective #%d on %s: %s. First divergent: %s."
                      % (key[1], label(key[0]), "; ".join(parts), _ranks(blamed)))
            return Finding("divergence", blamed, key[1], _report(report, details, missing),
                           details, comm=key[0])

    # 2. ranks that left no dump: they died; say what the survivors were doing
    if missing:
        failed = sorted((e for entries in by_rank.values() for e in entries.values()
                         if e["state"] not in ("ok", "pending")), key=lambda e: e["start"])
        if failed:
            key = (comm_of(failed[0]), number(failed[0]))
            in_it = sorted(r for r, entries in by_rank.items() if key in entries)
            report = ("%s stopped first (left no dump: died or was killed): %s failed in "
                      "collective %s on %s (%s)" % (_ranks(missing), _ranks(in_it),
                                                    _what(failed[0]), label(key[0]),
                                                    failed[0]["state"]))
            return Finding("stopped", missing, key[1], _report(report, details, missing),
                           details, comm=key[0])
        # the communicators the dead ranks were members of: how far the others got
        theirs = [(max(t[cid]["seq"] for t in comms.values() if cid in t), cid)
                  for cid, m in members.items() if set(m) & set(missing)]
        seq, cid = max(theirs) if theirs else (max(d["sequence"] for d in dumps), None)
        report = ("%s stopped first (left no dump: died or was killed); the others "
                  "reached collective #%d%s" % (_ranks(missing), seq,
                                                " on " + label(cid) if cid is not None else ""))
        return Finding("stopped", missing, seq, _report(report, details, missing), details,
                       comm=cid)

    # 3. every rank dumped and agrees: on each communicator, the members with the lowest
    # count stopped first; a communicator in use, and one where some member waits in a
    # collective (the longest), first
    behind_comms = []
    for cid, m in members.items():
        reached = {r: comms[r][cid]["seq"] for r in m if r in comms and cid in comms[r]}
        if not reached:
            continue
        low, high = min(reached.values()), max(reached.values())
        if low < high:
            ahead = sorted(r for r, s in reached.items() if s == high)
            waiting = [comms[r][cid].get("pending_since") or float("inf") for r in ahead]
            replaced = not any(comms[r][cid].get("current", True) for r in reached)
            behind_comms.append((replaced, min(waiting), cid, low, high, ahead, reached))
    if behind_comms:   # a communicator in use before one replaced (after a recovery)
        _, _, cid, low, high, ahead, reached = min(behind_comms, key=lambda b: b[:3])
        behind = sorted(r for r, s in reached.items() if s == low)
        entry = next((by_rank[r].get((cid, high)) for r in ahead if by_rank[r].get((cid, high))),
                     None)
        report = ("%s stopped first: it reached collective #%d on %s, while %s reached %s"
                  % (_ranks(behind), low, label(cid), _ranks(ahead),
                     _what(entry) if entry else "#%d" % high))
        return Finding("stopped", behind, low + 1, _report(report, details, missing), details,
                       comm=cid)
    counts = sorted(((members[cid], max(t[cid]["seq"] for t in comms.values() if cid in t), cid)
                     for cid in members
                     if any(t.get(cid, {}).get("current", True) for t in comms.values())),
                    key=lambda c: (-len(c[0]), c[0], c[2]))
    report = ("no divergence: every member of each communicator reached the same "
              "collective (%s)" % "; ".join("%s: #%d" % (label(cid), s) for _, s, cid in counts))
    high = counts[0][1] if counts else 0
    return Finding("consistent", [], high, _report(report, details, missing), details)


def _report(headline, details, missing) -> str:
    lines = [headline, ""] + details
    lines += ["rank %d: no dump" % r for r in missing]
    return "\n".join(lines)
