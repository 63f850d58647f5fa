"""Fair scheduling (``engine.scheduler``): a large request (many sequences, or a long prompt) cannot take
the steps, seats or KV blocks of regular requests. The scheduler runs here with its own factories (a block
manager, sequences, a fake model step); what a step costs is measured by ``lmforge bench reliability``."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

SMALL = dict(max_num_seqs=32, max_num_batched_tokens=256, block_size=4, num_kv_blocks=400, max_model_len=1024)


def make_scheduler(**changes) -> Scheduler:
    config = EngineConfig(**{**SMALL, **changes})
    return Scheduler(config, BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching))


def add_group(sched: Scheduler, group: str, prompt: list[int], n: int = 1, max_tokens: int = 50) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = Sequence(f"{group}-{i}", None, prompt, SamplingParams(max_tokens=max_tokens), None, None)
        seq.group_id, seq.index = group, i
        sched.add(seq)
        seqs.append(seq)
    return seqs


def step(sched: Scheduler) -> SchedulerOutput:
    """Schedule, 'run' the model (every sampling sequence gets token 7) and finish those at ``max_tokens``."""
    out = sched.schedule()
    sched.update_from_output(out, [[7] for item in out.scheduled if item.samples])
    for item in out.scheduled:
        seq = item.seq
        if seq.status == SequenceStatus.RUNNING and seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    sched.block_manager.check_invariants(sched.running)
    return out


def tokens_of(out: SchedulerOutput, group: str) -> tuple[int, int]:
    """(sequences, tokens) of ``group`` in step ``out``."""
    items = [item for item in out.scheduled if item.seq.group_id == group]
    return len(items), sum(item.num_new_tokens for item in items)


def test_a_large_n_request_gets_a_bounded_share_while_a_regular_one_runs_and_all_of_it_alone():
    sched = make_scheduler()
    big = add_group(sched, "big", list(range(1, 9)), n=30, max_tokens=40)
    for _ in range(3):
        step(sched)
    assert tokens_of(step(sched), "big")[0] == 30  # alone: every sequence, every step
    add_group(sched, "good", list(range(100, 110)), max_tokens=5)
    shares = []
    while any(s.group_id == "good" for s in (*sched.running, *sched.waiting)):
        out = step(sched)
        assert tokens_of(out, "good")[0] == 1  # the regular request runs in every step
        shares.append(tokens_of(out, "big"))
    assert shares and all(seqs <= 8 and tokens <= 32 for seqs, tokens in shares)
    # least recently run first: over the bounded steps every large sequence got its turns
    assert max(s.num_output_tokens for s in big) - min(s.num_output_tokens for s in big) <= 2
    assert tokens_of(step(sched), "big")[0] == 30  # the regular request finished: the whole step again


def test_a_regular_request_is_admitted_first_and_takes_a_seat_from_the_large_one():
    sched = make_scheduler(max_num_seqs=12)
    add_group(sched, "big", list(range(1, 9)), n=12, max_tokens=40)
    for _ in range(3):
        step(sched)
    assert len(sched.running) == 12 and not sched.waiting  # every seat taken
    add_group(sched, "good", list(range(100, 110)), max_tokens=3)
    out = step(sched)
    assert tokens_of(out, "good") == (1, 10)  # admitted at once (prefill of its 10 tokens)
    assert [s.group_id for s in out.preempted] == ["big"]  # one large sequence gave up its seat
    assert len(sched.running) == 12 and sum(s.group_id == "big" for s in sched.waiting) == 1
    while any(s.group_id == "good" for s in sched.running):
        step(sched)
    for _ in range(3):
        step(sched)
    assert sum(s.group_id == "big" for s in sched.running) == 12  # the large request took its seat back


def test_a_long_prompt_is_chunked_to_the_share_while_regular_requests_decode():
    sched = make_scheduler(long_prefill_token_threshold=64)
    add_group(sched, "good", list(range(100, 108)), max_tokens=30)
    step(sched)
    add_group(sched, "long", list(range(1, 601)))
    chunks = []
    for _ in range(5):
        out = step(sched)
        assert tokens_of(out, "good")[0] == 1
        chunks.append(tokens_of(out, "long")[1])
    assert chunks == [32] * 5  # not the 255 tokens the step budget would leave
    solo = make_scheduler(long_prefill_token_threshold=64)
    add_group(solo, "long", list(range(1, 601)))
    assert tokens_of(step(solo), "long")[1] == 256  # alone: the whole budget


def test_a_regular_request_takes_kv_blocks_from_the_large_one():
    sched = make_scheduler(num_kv_blocks=40, max_model_len=160, enable_prefix_caching=False)
    add_group(sched, "big", list(range(1, 13)), n=12, max_tokens=30)  # 12 x 3 blocks + growth
    for _ in range(6):
        step(sched)
    assert sched.block_manager.num_available_blocks < 5  # too few for the next prompt
    add_group(sched, "good", list(range(100, 117)), max_tokens=3)  # 17 tokens: 5 blocks
    out = step(sched)
    assert tokens_of(out, "good") == (1, 17)
    assert out.preempted and all(s.group_id == "big" for s in out.preempted)


def test_fair_share_off_is_first_come_first_served():
    sched = make_scheduler(max_num_seqs=12, fair_share_tokens=None)
    add_group(sched, "big", list(range(1, 9)), n=12, max_tokens=10)
    step(sched)
    add_group(sched, "good", list(range(100, 110)), max_tokens=3)
    out = step(sched)
    assert tokens_of(out, "good") == (0, 0) and tokens_of(out, "big")[0] == 12  # no seat until big finishes


def test_siblings_waiting_for_their_prefix_do_not_hold_back_the_queue():
    sched = make_scheduler()
    add_group(sched, "four", list(range(1, 40)), n=4, max_tokens=5)
    add_group(sched, "other", list(range(200, 210)), max_tokens=5)
    out = step(sched)
    assert tokens_of(out, "four")[0] == 1  # the first computes the prefix; its siblings hit it next step
    assert tokens_of(out, "other") == (1, 10)  # admitted now, not after the siblings
    out = step(sched)
    assert tokens_of(out, "four")[0] == 4
