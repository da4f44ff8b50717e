"""The tree or the chain, chosen by tokens/s per batch size (V2 runner).

vLLM's scheduler picks how many drafts the next step verifies from the batch size (its
``dynamic_sd_lookup``, built from num_speculative_tokens_per_batch_size).  With
``ddtree_budget_control='auto'`` on the V2 runner (DDTree's default there) every batch
size whose budget is a tree (k > C, C = ddtree_chain_budget) gets two arms: the tree
(k drafts) and the chain (C drafts: a chain step, v2_runtime.py).  ``ArmLookup``
answers the scheduler's lookup with the arm that delivered more tokens per second at
that batch size, on the scheduler's own clock (the time between two step outputs), and
plays the other arm for a few steps now and then, so a change of acceptance (another
prompt, another drafter) is seen.  Both arms are lossless: the choice moves speed only.

Tokens/s of an arm = tokens per step / seconds per step.  Seconds per step are
measured here (stable from a few steps).  Tokens per step, measured on each arm's own
steps, are too noisy to compare arms over a few steps (one step's accepted length
varies as much as its mean), so where the worker runs in this process (vLLM's
in-process executor: one GPU) it publishes both arms' tokens measured on the same tree
steps (paired.py: the chain's accepted length is read off the tree step's output),
through the engine's ArmChannel (channel.py: expected); elsewhere (TP > 1) the
measured tokens stand in.  The verify width is fixed a step
ahead (async scheduling), so the choice is per batch size, not per step as on V1
(core/budget.py).  Where both counts are published, the chain leads only once MIN_ROWS
paired rows are in and the tree trails it by more than Z standard errors (spread):
only a tree step adds rows, so a close call goes to the tree, which settles it, and a
chain picked on a few rows would hold until its next exploration (run 21, H100, 27B
shape: after 3 rows the chain led and held 16-20 steps of a p60 cell where the fixed
tree ran 1.06x the choice; bench/arms_sim.py reproduced it, 0.947 of the faster arm,
and gives 0.985 with this rule); each count's spread has a floor (PRIOR_VAR), so rows
that all agree are not read as certainty.  Else (measured tokens) the other arm must beat the
leader by MARGIN. The first steps of each arm calibrate (MIN_STEPS; MIN_PAIRED with
paired counts, where the tree's steps give the chain's tokens too; the chain's in one run
of that many steps plus the switch's, then the tree while their outputs are in flight,
IN_FLIGHT steps: async scheduling chooses before they land); after that, a choice
holds WINDOW steps, and every EXPLORE-th choice (4 x EXPLORE once one is clearly ahead,
by 2 Z standard errors or by CLEAR on measured tokens, and both arms have WELL steps;
with paired counts a tree that clearly leads needs none of the chain's beyond its
calibration, whose tokens come from the tree steps: H100, 8B shape, a cold p60 cell of
68 steps spent 8 on the chain; EXPLORE / 4 while the chain leads by less than 2 Z) plays
the other arm. A step time is the median of an arm's last RECENT steps, the first step
after a switch left out (H200, run 8: at one request the tree's first 5 measured steps
averaged 12.5-16.6 ms, its 18 steps of another run 7.9 ms; the cause was not found).
That first step's excess over the new arm's median is the switch's cost (summary:
switch_ms); where it is positive a choice holds long enough that a switch costs at most
SWITCH_SHARE of its steps (simulated with 5 ms a switch, bench/arms_sim.py: 0.964-0.968
-> 0.977-0.981 of the chain where the chain wins). ddtree_arms=[window, explore]
overrides WINDOW and EXPLORE and pins the window (tests; settings.py refuses a bad value
at engine configuration). ``trace`` keeps the last TRACE measured steps with the
estimates published at each (step_bench.py saves it per cell: the estimator replayed
against what each arm realized). ``renew`` starts a fresh controller (benchmarks: each
cell afresh); renew(keep_times=True) keeps the step times, as a running server does.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from .. import log
from .channel import ArmChannel

WINDOW = 4
EXPLORE = 16
CLEAR = 1.15
MIN_STEPS = 4  # calibration steps per arm on measured tokens
MIN_PAIRED = 2  # and where the worker half publishes paired counts (channel.paired)
WELL = 12  # steps of the less played arm before exploring less than every EXPLORE-th
RECENT = 16  # step times kept per arm
DECAY = 0.97  # weight of older steps, per step of the same arm
MARGIN = 1.02  # measured tokens: the other arm must beat the leader by 2 % to lead
SWITCH_SHARE = 0.1  # a choice holds long enough that a measured switch costs <= 10 %
Z = 1.0  # published counts: the chain leads only where it leads by Z std errors
MIN_ROWS = 8  # and only once this many paired rows (request-steps of the tree) are in
# a floor under each count's spread, PRIOR_VAR tokens^2 over PRIOR_ROWS + rows: rows
# that all agree (every draft rejected on both arms, a text's first steps) give a finite
# edge, not -inf, so the chain then leads without a "clear" lead and the tree is looked
# at again soon (realpair text 7: 14 rows of 0 accepted); where the counts vary (a weak
# drafter: var ~0.2 from the first rows) it hardly binds
PRIOR_ROWS = 2.0
PRIOR_VAR = 1.0
LOG_EVERY = 60.0  # seconds between two log lines of the arms' rates
TRACE = 4096  # measured steps kept for a replay of the estimates (``trace``)
# vLLM's async scheduling sets the drafts of step j + 1 when it schedules step j, after
# the output of step j - 2: 2 steps are in flight between the last output seen and the
# step a choice sets (run 24, H100: a cold cell's chain calibration took two windows,
# 8 steps, its second chosen before the first's outputs were in)
IN_FLIGHT = 2


class Arm:
    """One arm at one batch size: decayed sums of its output tokens and seconds, and
    its recent step times (their median is its step time: robust to a slow step)."""

    __slots__ = ("tokens", "seconds", "weight", "steps", "recent")

    def __init__(self):
        self.tokens = self.seconds = self.weight = 0.0
        self.steps = 0
        self.recent = deque(maxlen=RECENT)

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.weight = self.weight * DECAY + 1.0
        self.recent.append(seconds)
        self.steps += 1

    @property
    def per_step(self) -> float:
        """Measured output tokens per step (decayed like the rate)."""
        return self.tokens / self.weight if self.weight > 0 else 0.0

    @property
    def rate(self) -> float:
        """Measured output tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_s(self) -> float:
        """Median seconds per step over the last RECENT steps."""
        return statistics.median(self.recent) if self.recent else 0.0


class ArmLookup(list):
    """vLLM's lookup (index = number of scheduled requests -> drafts), with the tree
    batch sizes answered by the arm choice.  ``observe`` takes each step's output."""

    def __init__(self, lookup, chain: int, channel: ArmChannel | None = None,
                 pinned: tuple[int, int] | None = None, clock=time.perf_counter):
        super().__init__(lookup)
        self.chain = chain
        # the worker half's counts (DDTreeConfig.channel; a scheduler alone: its own)
        self.channel = ArmChannel() if channel is None else channel
        # ddtree_arms pins (window, explore): tests that switch at every step keep doing so
        self.pinned = pinned
        self.window, self.explore = (WINDOW, EXPLORE) if pinned is None else pinned
        self.clock = clock
        # batch size -> (tree drafts, chain drafts), for the sizes whose budget is a tree
        self.arms = {n: (k, chain) for n, k in enumerate(lookup) if n and k > chain >= 1}
        self.stats = {(n, k): Arm() for n, ks in self.arms.items() for k in ks}
        self.current = {n: ks[0] for n, ks in self.arms.items()}
        self.hold = dict.fromkeys(self.arms, 0)
        self.choices = dict.fromkeys(self.arms, 0)
        self.calibrating = dict.fromkeys(self.arms, False)  # the chain's steps in flight
        self.leader = {n: ks[0] for n, ks in self.arms.items()}
        self.picked = {key: 0 for key in self.stats}  # choices made, per arm
        self._last = None  # clock at the previous output, when that step was a decode
        self._logged = clock()
        self._width: dict[int, int] = {}  # batch size -> drafts of its last decode step
        # batch size -> [switches measured, the last RECENT first steps' excess seconds]
        self.switches: dict[int, list] = {}
        # the last TRACE measured steps: [batch size, drafts, tree arm?, ms, tokens, the
        # published expected tokens per request-step of the tree and the chain (None:
        # not yet)]
        self.trace: deque = deque(maxlen=TRACE)
        self.channel.clear()  # a fresh start: nothing of an earlier drafter's

    def renew(self, keep_times: bool = False) -> "ArmLookup":
        """A fresh controller (nothing measured) on the same lookup, channel and knobs;
        keep_times: but the arms' step times and switch costs carry over (a running
        server meeting new text: a step's cost is the hardware's, not the text's), so
        with paired counts the chain needs no calibration steps of its own."""
        new = type(self)(list(self), self.chain, self.channel, self.pinned, self.clock)
        if keep_times:
            for key, arm in self.stats.items():
                new.stats[key].recent.extend(arm.recent)
            new.switches = {n: [sw[0], deque(sw[1], maxlen=RECENT)]
                            for n, sw in self.switches.items()}
        return new

    def __getitem__(self, n):
        if type(n) is int and n in self.arms:
            return self.choose(n)
        return super().__getitem__(n)

    def choose(self, n: int) -> int:
        if self.hold[n] > 0:
            self.hold[n] -= 1
            return self.current[n]
        tree, chain = self.arms[n]
        t, c = self.stats[(n, tree)], self.stats[(n, chain)]
        least = MIN_PAIRED if self.channel.paired else MIN_STEPS
        steps = None  # the choice's window (None: _window's)
        if t.steps < least:
            pick = tree
        elif c.steps < least and not (self.channel.paired and len(c.recent) >= least):
            # with paired counts the chain's tokens come from tree steps: a step time it
            # already has (renew(keep_times=True)) calibrates it.  Calibration: the
            # switch's step and `least` measured ones, then the tree while their
            # outputs are still in flight (IN_FLIGHT), not a second window of the chain
            if self.calibrating[n]:
                pick, steps = tree, IN_FLIGHT
            else:
                pick, steps = chain, least + 1
            self.calibrating[n] = not self.calibrating[n]
        else:
            rate = self.rates(n)
            lead = self.leader[n]
            other = chain if lead == tree else tree
            edge = self.edge(n)
            if edge is not None and self.channel.spread[n][3] < MIN_ROWS:
                edge = 0.0  # too few paired rows to tell: the tree, which adds rows
            if edge is not None:  # paired counts: the chain only where it clearly leads
                lead, other = (tree, chain) if edge > -Z else (chain, tree)
            elif rate[other] > MARGIN * rate[lead]:
                lead, other = other, lead
            self.leader[n] = best = lead
            lo = min(rate.values())
            # paired counts price the chain on tree steps: while the tree leads, the
            # chain's own steps give only its step time, known from its calibration
            known = edge is not None and best == tree or min(t.steps, c.steps) >= WELL
            clear = abs(edge) > 2 * Z if edge is not None else \
                lo > 0 and max(rate.values()) > CLEAR * lo
            period = self.explore * (4 if known and clear else 1)
            if edge is not None and -2 * Z < edge <= -Z:  # the tree may lead: look soon
                period = max(2, self.explore // 4)
            self.choices[n] += 1
            pick = other if self.choices[n] % period == 0 else best
        self.current[n] = pick
        self.hold[n] = (steps or self._window(n)) - 1
        self.picked[(n, pick)] += 1
        return pick

    def _window(self, n: int) -> int:
        """Steps a choice holds: WINDOW, or as many as make a measured switch cost at
        most SWITCH_SHARE of them (up to 4 x WINDOW); ddtree_arms's, fixed."""
        excess = self.switch_s(n)
        steps = [self.stats[(n, k)].step_s for k in self.arms[n]]
        if self.pinned is not None or excess is None or excess <= 0 or min(steps) <= 0:
            return self.window
        per = excess / (SWITCH_SHARE * min(steps))
        return max(self.window, min(4 * self.window, math.ceil(per)))

    def switch_s(self, n: int) -> float | None:
        """What a switch costs at batch size n beyond the new arm's step (median of the
        last RECENT measured; robust to one slow step), None before 2 are measured."""
        sw = self.switches.get(n)
        return statistics.median(sw[1]) if sw and len(sw[1]) >= 2 else None

    def rates(self, n: int) -> dict[int, float]:
        """Tokens/s per arm at batch size n: the worker's expected tokens per step over
        the measured step time when published (channel.expected), else the measured
        tokens."""
        ks = self.arms[n]
        exp = self.channel.expected.get(n)
        if exp is None:
            return {k: self.stats[(n, k)].rate for k in ks}
        return {k: e / s.step_s if s.step_s > 0 else 0.0
                for k, e, s in zip(ks, exp, (self.stats[(n, k)] for k in ks))}

    def edge(self, n: int) -> float | None:
        """The tree's lead over the chain in tokens/s per request, in standard errors of
        the paired counts (channel.spread), or None before both counts and step times
        are known."""
        exp, spread = self.channel.expected.get(n), self.channel.spread.get(n)
        tree, chain = self.arms[n]
        a, b = self.stats[(n, tree)].step_s, self.stats[(n, chain)].step_s
        if exp is None or spread is None or a <= 0 or b <= 0:
            return None
        vt, vc, cov, rows = spread
        diff = exp[0] / a - exp[1] / b
        rows = max(rows, 1.0)
        floor = PRIOR_VAR * PRIOR_ROWS / (rows + PRIOR_ROWS)
        vt, vc = max(vt, floor), max(vc, floor)
        var = (vt / (a * a) + vc / (b * b) - 2 * cov / (a * b)) / rows
        if var <= 0:  # PRIOR_VAR = 0 and no spread
            return math.copysign(math.inf, diff) if diff else 0.0
        return diff / math.sqrt(var)

    def observe(self, scheduler_output, model_runner_output) -> None:
        """A step's output: for a pure decode step (every request verifies the same k
        drafts) whose previous step was one too, the tokens it emitted over the time
        since that step's output go to the arm (batch size, k).  An output it cannot
        read turns the choice off (the fixed schedule answers), with one warning: the
        scheduler must never fail for it."""
        if not self.arms:
            return
        try:
            self._observe(scheduler_output, model_runner_output)
        except Exception as e:  # noqa: BLE001
            self.arms = {}
            _log(f"turned off (fixed schedule from now on): cannot read a step output: "
                 f"{e!r}", warn=True)

    def _observe(self, scheduler_output, model_runner_output) -> None:
        now = self.clock()
        last, self._last = self._last, None
        sched = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        n = len(sched)
        if not n or len(drafts) != n:
            return
        k = None
        for req, num in sched.items():
            d = drafts.get(req)
            if d is None or (k is not None and len(d) != k) or num != 1 + len(d):
                return
            k = len(d)
        self._last = now
        arm = self.stats.get((n, k))
        switched, self._width[n] = self._width.get(n) != k, k
        if arm is None or last is None:
            return
        if switched:  # the first step after a switch may hold the other arm's tail: not
            if arm.recent:  # an arm step, but its excess over the arm's median is kept
                sw = self.switches.setdefault(n, [0, deque(maxlen=RECENT)])
                sw[0] += 1
                sw[1].append((now - last) - arm.step_s)
            return
        sampled = model_runner_output.sampled_token_ids or []
        tokens = sum(len(x) for x in sampled)
        arm.add(tokens, now - last)
        exp = self.channel.expected.get(n, (None, None))
        self.trace.append([n, k, k == self.arms[n][0], round((now - last) * 1e3, 4), tokens,
                           *(None if e is None else round(e, 4) for e in exp)])
        if now - self._logged > LOG_EVERY:
            self._logged = now
            _log(self.summary())

    def summary(self) -> dict:
        """Per tree batch size: each arm's measured tokens/s, ms per step, tokens per
        request-step ("measured": what the arm realized on its own steps, to hold
        against "expected", the published estimate in the same unit), steps seen,
        times chosen, and (when published) the expected tokens per step, the
        tree's "edge" in standard errors, the measured "switches" and what one costs
        beyond the new arm's step ("switch_ms": switch_s), and under "subtrees" the
        tokens of smaller trees priced on the same steps."""
        out = {}
        for n, ks in self.arms.items():
            exp = self.channel.expected.get(n, (None, None))
            out[n] = {("tree" if k == ks[0] else "chain") + f" {k}": {
                "tok_per_s": round(self.stats[(n, k)].rate, 1),
                "ms": round(1e3 * self.stats[(n, k)].step_s, 3),
                "measured": round(self.stats[(n, k)].per_step / n, 3),
                "expected": None if e is None else round(e, 3),
                "steps": self.stats[(n, k)].steps, "chosen": self.picked[(n, k)]}
                for k, e in zip(ks, exp)}
            edge = self.edge(n)
            if edge is not None:
                out[n]["edge"] = round(max(-99.0, min(99.0, edge)), 2)
            if self.switch_s(n) is not None:  # a switch's cost beyond the new arm's step
                out[n]["switches"] = self.switches[n][0]
                out[n]["switch_ms"] = round(1e3 * self.switch_s(n), 3)
            subtrees = self.channel.subtrees.get(n)
            if subtrees is not None:
                out[n]["subtrees"] = {b: round(v, 3) for b, v in subtrees.items()}
        return out


def _log(what, warn: bool = False) -> None:
    log(__name__, "DDTree tree vs chain by batch size: %s", what, warn=warn)


def wrap_lookup(scheduler, lookup):
    """Scheduler.__init__ hook: the arm lookup when DDTree's controller runs on the V2
    runner and some batch size verifies a tree, else ``lookup`` unchanged."""
    spec = getattr(getattr(scheduler, "vllm_config", None), "speculative_config", None)
    cfg = getattr(spec, "ddtree_config", None)
    if lookup is None or cfg is None or not cfg.v2 or cfg.budget_control != "auto":
        return lookup
    arms = ArmLookup(lookup, cfg.chain_budget, cfg.channel, cfg.arms)
    return arms if arms.arms else lookup
