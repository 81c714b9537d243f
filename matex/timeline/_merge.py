"""Merging the ranks' timeline files into one trace, one process row per rank.

Each rank's file only knows when it arrived at a collective and when all had
arrived; with every rank's (aligned) start at hand, the merge splits that
span into "wait for the slowest rank" (until the last rank arrived, named in
the span) and "agreement check" (from then until the check completed).

A collective is the same one on two ranks when it has the same number on the
same communicator (``comm``, ``comm_seq``): each communicator (a search
group, a grid's groups, the one after a recovery) has its own order, so the
process-wide ``seq`` pairs the wrong collectives as soon as ranks run
different numbers of collectives on sub-communicators. Point-to-point
transfers (``comm_seq`` 0) have no such order and are not split.
"""

import json
import re
from pathlib import Path

from matex.timeline._writer import FORMAT, TimelineError

_NAME = re.compile(r"^timeline-rank(\d+)\.json$")


def read(path) -> list:
    """The events of one rank's file; also reads a file its rank never closed (killed)."""
    text = Path(path).read_text()
    try:
        events = json.loads(text)
    except ValueError:
        body = text.strip()
        body = body[:-1] if body.endswith("]") else body
        lines = body.lstrip("[").strip().rstrip(",").splitlines()
        events = []
        for line in lines:
            line = line.strip().rstrip(",")
            if line:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    break   # a line cut short by a crash: the rest is lost
    if not isinstance(events, list):
        raise TimelineError("%s is not a timeline (not a JSON array of events)" % path)
    return events


def load(directory) -> dict:
    """rank -> events of every ``timeline-rank<N>.json`` in ``directory``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TimelineError("matex.timeline: %s is not a directory" % directory)
    ranks = {}
    for path in sorted(directory.iterdir()):
        m = _NAME.match(path.name)
        if m:
            ranks[int(m.group(1))] = read(path)
    if not ranks:
        raise TimelineError("matex.timeline: no timeline files (timeline-rank<N>.json) in %s"
                            % directory)
    metas = {r: next((e["args"] for e in evs if e.get("name") == "matex_timeline"), None)
             for r, evs in ranks.items()}
    for r, meta in metas.items():
        if meta is None or meta.get("format") != FORMAT:
            raise TimelineError("matex.timeline: %s holds no MaTEx timeline header"
                                % (directory / ("timeline-rank%d.json" % r)))
    origins = {(m.get("job"), m.get("origin_s")) for m in metas.values()}
    if len(origins) > 1:
        raise TimelineError("matex.timeline: the files in %s come from different runs "
                            "(job ids / start times differ); remove the old ones" % directory)
    return ranks


def _key(args):
    """The collective an event belongs to, the same on every member of its communicator
    (None: a point-to-point transfer). Files before (comm, comm_seq) pair by ``seq``."""
    if "comm_seq" not in args:
        return ("", args["seq"])
    return (args["comm"], args["comm_seq"]) if args["comm_seq"] > 0 else None


def split_arrivals(ranks: dict) -> None:
    """Replace each "arrive" span by the wait for the slowest rank and the agreement check."""
    latest = {}   # (comm, comm_seq) -> (aligned start, rank) of the last rank to arrive
    for r, events in ranks.items():
        for e in events:
            if e.get("cat") == "collective":
                key = _key(e["args"])
                if key is not None and (key not in latest or e["ts"] > latest[key][0]):
                    latest[key] = (e["ts"], r)
    for r, events in ranks.items():
        out = []
        for e in events:
            if e.get("cat") != "arrive" or _key(e["args"]) is None:
                out.append(e)
                continue
            key = _key(e["args"])
            ids = {k: v for k, v in e["args"].items() if k in ("seq", "comm", "comm_seq")}
            last, slowest = latest.get(key, (e["ts"], r))
            end = e["ts"] + e["dur"]
            cut = min(max(last, e["ts"]), end)
            out.append(dict(e, name="wait for the slowest rank (rank %d)" % slowest,
                            cat="wait", dur=round(cut - e["ts"], 3),
                            args=dict(ids, slowest_rank=slowest)))
            out.append(dict(e, name="agreement check", cat="check", ts=cut,
                            dur=round(end - cut, 3), args=ids))
        ranks[r] = out


def merge(directory, output=None):
    """Write the merged trace; return ``(path, ranks, number of events)``."""
    ranks = load(directory)
    split_arrivals(ranks)
    path = Path(output) if output else Path(directory) / "merged.json"
    count = 0
    with open(path, "w") as f:
        f.write("[\n")
        first = True
        for r in sorted(ranks):
            for e in ranks[r]:
                if e.get("name") == "matex_timeline_end":
                    continue
                f.write(("" if first else ",\n") + json.dumps(e, separators=(",", ":")))
                first = False
                count += 1
        f.write("\n]\n")
    return path, sorted(ranks), count
