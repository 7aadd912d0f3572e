"""Parallel sampling (n > 1) on shared blocks. A request with n samples starts as one sequence, the
leader. When the leader's prompt is computed, n - 1 siblings are forked from it: the prompt's blocks
before the one holding its last token are shared (one more reference each: the pool holds them
once), and that last block is copied (copy on write: each sequence writes its own continuation into
it). A sibling then computes only the last prompt token again, in its own copy, and samples its own
first token from it with its own seed (the request's seed + its index, as vLLM derives them)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.request import Request, RequestStatus


@dataclass
class Family:
    """One user-facing request: its id and its n sequences (internal ids `id`, `id#1`, ...)."""
    request_id: str
    n: int
    live: set[str] = field(default_factory=set)  # sequences not finished yet
    forked: bool = False

    def sibling_id(self, index: int) -> str:
        return self.request_id if index == 0 else f"{self.request_id}#{index}"


def child_params(params, index: int):
    """The params of sequence `index`: one sample each, the seed derived from the request's; the
    prompt's logprobs come with the leader (index 0), which alone computes the whole prompt."""
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, stop=list(params.stop_strings), prompt_logprobs=prompt_logprobs)


def fork(leader: Request, family: Family, kv, runner, scheduler, max_num_seqs: int, prepare) -> list[Request]:
    """The leader's siblings, sharing its computed prompt. Each goes straight to the running batch
    with its blocks; if the pool has no block for its copy (or the batch is full), it waits like a
    new request instead (the prefix cache still gives it the full blocks). prepare(child) gives
    each what admission gives a request (its grammar, its bad words)."""
    family.forked = True
    prompt_len = leader.num_prompt_tokens
    siblings = []
    for index in range(1, family.n):
        child = Request(family.sibling_id(index), leader.prompt_token_ids, child_params(leader.params, index),
                        prompt=leader.prompt, priority=leader.priority, eos_token_ids=leader.eos_token_ids,
                        cache_salt=leader.cache_salt, session_id=leader.session_id)
        prepare(child)
        copied = len(scheduler.running) < max_num_seqs and kv.fork(leader, child, prompt_len)
        if copied:
            runner.copy_block(*copied)
            child.num_computed_tokens = child.num_cached_tokens = prompt_len - 1
            child.status = RequestStatus.RUNNING
            scheduler.running.append(child)
        else:
            scheduler.add_request(child)
        family.live.add(child.request_id)
        siblings.append(child)
    return siblings
