"""Scheduler policy in isolation: a fake runner result stands in for the model."""
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, **cfg):
    config = EngineConfig(block_size=16, **cfg)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    return Scheduler(config, kv, max_model_len=1000), kv


def request(rid, n, priority=0, max_tokens=100):
    """Distinct token ids per request id, so nothing is shared through the prefix cache."""
    start = 1 + 1000 * (sum(map(ord, rid)) % 97)
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   priority=priority)


def run_step(sched):
    out = sched.schedule()
    sampled = {s.request.request_id: [7] for s in out.scheduled if s.samples}
    sched.update(out, ModelRunnerOutput(sampled))
    return out


def test_running_requests_decode_before_new_prompts_are_chunked_in():
    sched, _ = make(max_num_batched_tokens=10)
    a = request("a", 6)
    sched.add_request(a)
    assert [(s.request.request_id, s.num_tokens) for s in run_step(sched).scheduled] == [("a", 6)]
    sched.add_request(request("b", 30))
    out = run_step(sched)
    # a decodes first (1 token), b gets the other 9 of the budget as a prefill chunk
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.scheduled[1].samples is False
    out = run_step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_bounds_the_batch():
    sched, _ = make(max_num_seqs=2)
    for i in range(4):
        sched.add_request(request(str(i), 3))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["0", "1"]
    assert sched.num_waiting == 2


def test_pool_exhaustion_preempts_the_latest_arrival_and_resumes_it():
    sched, kv = make(num_blocks=4, block_size=4)  # 16 token slots
    a, b = request("a", 7), request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both prefilled: 2 blocks each, pool full
    run_step(sched)  # 8 tokens each: still 2 blocks
    out = run_step(sched)  # a needs a third block: b (latest) is preempted
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    while not a.is_finished:
        run_step(sched)
        if a.num_output_tokens >= 3:
            sched.finish(a, RequestStatus.FINISHED_ABORTED)
    run_step(sched)
    assert b.status == RequestStatus.RUNNING
    assert b.num_computed_tokens == b.num_tokens - 1  # recomputed prompt + its earlier output


def test_priority_arrival_preempts_lower_priority_work():
    sched, kv = make(num_blocks=4, block_size=4, scheduling_policy="priority")
    low = [request(f"low{i}", 7, priority=5) for i in range(2)]
    for r in low:
        sched.add_request(r)
    run_step(sched)
    urgent = request("urgent", 7, priority=0)
    sched.add_request(urgent)
    out = run_step(sched)
    assert urgent in [s.request for s in out.scheduled]
    assert low[1] in out.preempted


def test_abort_frees_blocks_at_once_in_any_state():
    sched, kv = make()
    running, waiting = request("r", 9), request("w", 9)
    sched.add_request(running)
    run_step(sched)
    sched.add_request(waiting)
    assert kv.pool.num_used == 3
    sched.finish(running, RequestStatus.FINISHED_ABORTED)
    sched.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_used == 0 and not sched.running and sched.num_waiting == 0
    assert run_step(sched).is_empty


def test_stop_rules():
    sched, _ = make()
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]),
                eos_token_ids=(9,))
    sched.add_request(r)
    run_step(sched)  # samples 7 but min_tokens=2 keeps it going
    assert not r.is_finished
    run_step(sched)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
