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
  drain are the gpipe argument on fewer micro-batches.

``simulate`` replays the schedules under those semantics and reports the
first stuck state; tests run it for P up to 8 and M up to 24 on both
schedules.
"""

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


def steps(schedule, stages, stage, micro, train=True):
    """The steps of ``stage``, transfers filled in and fused (see the module doc)."""
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
    """Replay every stage's transfers with rendezvous semantics; None, or why it is stuck."""
    ops = [transfers(steps(schedule, stages, p, micro, train)) for p in range(stages)]
    pos = [0] * stages
    pending = []   # per stage: set of unfinished parts of its current op
    for p in range(stages):
        pending.append(_parts(ops[p][0]) if ops[p] else set())
    while True:
        if all(pos[p] >= len(ops[p]) for p in range(stages)):
            return None
        progress = False
        for p in range(stages):
            if pos[p] >= len(ops[p]):
                continue
            for part in list(pending[p]):
                if part[0] != "send" or part not in pending[p]:
                    continue
                q = part[1]
                if pos[q] < len(ops[q]) and ("recv", p) in pending[q]:
                    pending[p].discard(part)
                    pending[q].discard(("recv", p))
                    progress = True
        for p in range(stages):
            while pos[p] < len(ops[p]) and not pending[p]:
                pos[p] += 1
                pending[p] = _parts(ops[p][pos[p]]) if pos[p] < len(ops[p]) else set()
                progress = True
        if not progress:
            return "stuck: " + "; ".join(
                "stage %d at %s" % (p, ops[p][pos[p]] if pos[p] < len(ops[p]) else "end")
                for p in range(stages))


def _parts(op):
    if op[0] == "send":
        return {("send", op[1])}
    if op[0] == "recv":
        return {("recv", op[1])}
    return {("send", op[1]), ("recv", op[2])}
