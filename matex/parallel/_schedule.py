"""Micro-batch schedules of a pipeline: what each stage does, in which order.

A schedule is, per stage, a list of steps. A step computes one micro-batch's
forward (``"F"``) or backward (``"B"``) and names the transfers around it:
what it receives before computing and what it sends after. Sends and receives
that are adjacent and face the same neighbour are fused into one
send-receive, which is what makes 1F1B deadlock-free (below).

* ``gpipe``: all M forwards, then all M backwards (GPipe). Activations of all
  M micro-batches are alive at the turn.
* ``1f1b``: one-forward-one-backward (PipeDream-flush, as in Megatron-LM):
  stage p runs ``min(P - p - 1, M)`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards. At most
  ``P - p`` micro-batches' activations are alive on stage p.

Deadlock freedom, assuming the strictest transfer semantics (a send returns
only once its receiver has posted the matching receive; MaTEx's p2p ops
exchange a header first, so they behave so):

* Transfers between stages p and p+1 are matched in issue order (MPI's
  non-overtaking rule per pair and tag); forward activations only flow
  p -> p+1 and gradients only p+1 -> p, each stream in micro-batch order
  on both ends.
* gpipe: in the forward phase stage p's k-th send meets stage p+1's k-th
  receive, which p+1 posts once its own (k-1)-th send completed; by induction
  from the last stage (which only receives) every forward transfer
  completes. The backward phase is the mirror image from stage P-1 down.
* 1f1b: in the steady phase stage p sends activation m to p+1 and at once
  waits for a gradient from p+1; stage p+1 at that moment sends a gradient to
  p and at once waits for activation m: both sides are one fused
  send-receive with each other, which completes as a pair. Warm-up and
  drain are the gpipe argument on fewer micro-batches. A fusion is kept only
  where the peer fuses too (a send-receive is assumed to match only a
  send-receive); ``steps`` undoes the others.

``simulate`` replays the schedules under those semantics and reports the
first stuck state; tests run it for P up to 8 and M up to 24 on both
schedules (and show that 1F1B without fusion is stuck).
"""

from matex import _state

SCHEDULES = ("gpipe", "1f1b")


class Step:
    """One compute step of a stage and its transfers.

    ``kind``: "F" or "B"; ``micro``: micro-batch index. ``recv``: (peer, what)
    received before computing, or None; ``send``: (peer, what) sent after.
    ``fused_send``: set on a step whose send is fused with the *next* step's
    receive (same peer): both happen in one send-receive after this step.
    """

    __slots__ = ("kind", "micro", "recv", "send", "fused_send", "fused_recv")

    def __init__(self, kind, micro, recv, send):
        self.kind, self.micro, self.recv, self.send = kind, micro, recv, send
        self.fused_send = False   # this step's send goes out with the next step's receive
        self.fused_recv = False   # this step's receive came with the previous step's send

    def __repr__(self):
        return "%s%d" % (self.kind, self.micro)


def order(schedule, stages, stage, micro):
    """The (kind, micro-batch) order of compute steps on ``stage``."""
    if schedule not in SCHEDULES:
        raise ValueError("schedule must be one of %s, not %r" % (", ".join(SCHEDULES), schedule))
    if schedule == "gpipe":
        return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    warm = min(stages - stage - 1, micro)
    out = [("F", m) for m in range(warm)]
    for i in range(micro - warm):
        out += [("F", warm + i), ("B", i)]
    out += [("B", m) for m in range(micro - warm, micro)]
    return out


def _candidates(schedule, stages, stage, micro, train=True):
    """The steps of ``stage`` with every adjacent send/receive pair to one peer fused."""
    kinds = order(schedule, stages, stage, micro) if train else [("F", m) for m in range(micro)]
    out = []
    for kind, m in kinds:
        if kind == "F":
            recv = (stage - 1, "activation") if stage > 0 else None
            send = (stage + 1, "activation") if stage < stages - 1 else None
        else:
            recv = (stage + 1, "gradient") if stage < stages - 1 else None
            send = (stage - 1, "gradient") if stage > 0 else None
        out.append(Step(kind, m, recv, send))
    for a, b in zip(out, out[1:]):
        if a.send is not None and b.recv is not None and a.send[0] == b.recv[0] \
                and a.kind != b.kind:
            a.fused_send, b.fused_recv = True, True
    return out


_plans = _state.table("parallel.schedule.plans", lifetime="session")   # rebuilt on demand


def steps(schedule, stages, stage, micro, train=True):
    """The steps of ``stage``, transfers filled in, fused only where both ends fuse.

    A send-receive is matched only by a send-receive of its peer (the
    conservative reading of the p2p ops), so a candidate fusion whose peer
    does a plain send or receive at that point is undone; ``simulate`` checks
    the result.
    """
    key = (schedule, stages, micro, train)
    if key not in _plans:
        plan = [_candidates(schedule, stages, p, micro, train) for p in range(stages)]
        while True:
            stuck = _replay(plan)
            if stuck is None:
                break
            fused = [(p, i) for p, i, op in stuck if op is not None and op[0] == "sendrecv"]
            if not fused:
                raise RuntimeError("no deadlock-free transfer order for %r" % (key,))
            p, i = fused[0]
            b = _sources(plan[p])[i]
            plan[p][b - 1].fused_send = plan[p][b].fused_recv = False
        _plans[key] = plan
    return _plans[key][stage]


def _sources(stage_steps):
    """For each transfer of ``transfers(stage_steps)``: the index of the step issuing it."""
    out = []
    for i, s in enumerate(stage_steps):
        if s.fused_recv or s.recv is not None:
            out.append(i)
        if s.send is not None and not s.fused_send:
            out.append(i)
    return out


def transfers(stage_steps):
    """The stage's transfers in issue order: ("send", peer), ("recv", peer) or
    ("sendrecv", send_peer, recv_peer)."""
    flat, prev = [], None
    for s in stage_steps:
        if s.fused_recv:
            flat.append(("sendrecv", prev.send[0], s.recv[0]))
        elif s.recv is not None:
            flat.append(("recv", s.recv[0]))
        if s.send is not None and not s.fused_send:
            flat.append(("send", s.send[0]))
        prev = s
    return flat


def simulate(schedule, stages, micro, train=True):
    """Replay every stage's transfers; None, or a description of where they are stuck."""
    stuck = _replay([steps(schedule, stages, p, micro, train) for p in range(stages)])
    if stuck is None:
        return None
    return "stuck: " + "; ".join("stage %d at %s" % (p, op) for p, _, op in stuck)


def _replay(plan):
    """Rendezvous replay: a send meets a receive; a send-receive meets only a send-receive.

    Returns None when every transfer completes, else [(stage, op index, op)].
    """
    ops = [transfers(s) for s in plan]
    n = len(ops)
    pos = [0] * n
    while True:
        if all(pos[p] >= len(ops[p]) for p in range(n)):
            return None
        progress = False
        for p in range(n):
            if pos[p] >= len(ops[p]):
                continue
            op = ops[p][pos[p]]
            q = op[1]
            peer = ops[q][pos[q]] if op[0] != "recv" and pos[q] < len(ops[q]) else None
            if (op[0] == "send" and peer == ("recv", p)) or (
                    op[0] == "sendrecv" and op[2] == q and peer == ("sendrecv", p, p)):
                pos[p] += 1
                pos[q] += 1
                progress = True
        if not progress:
            return [(p, pos[p], ops[p][pos[p]] if pos[p] < len(ops[p]) else None)
                    for p in range(n)]
