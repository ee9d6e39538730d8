"""FALLBACK generation with the actor's own megatron model, for machines without vLLM.

It is a plain sampling loop meant for correctness, tests and debugging, not for speed: ``generate`` samples the
replies of prompts of one length as one batch (``max_batch_rows``), feeds them once and then one token per step
through a decode cache (``rlhf.rollout.decode_cache``: megatron's KV cache for softmax attention, the convolution
window and recurrent state for Gated DeltaNet layers) where the model allows one, else the whole sequence per token
(named once in the log); the partial-rollout rounds and the agents' requests always feed whole sequences.
``build_rollout`` logs a warning when it is chosen. It shares the actor's weights, so a "weight sync" is a no-op.
Sampling follows vLLM's semantics: ``log_softmax(logits / temperature)`` log-probs, optional nucleus (top-p)
filtering, stop at EOS; the draw (``sample_rows``) runs on the model's device, one uniform per row from a CPU
generator, so the tokens do not depend on the device.
"""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from rlhf.rollout.types import RolloutConfig, Sample
from rlhf.rollout.vllm_generator import gather_samples

log = logging.getLogger(__name__)


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``(n, V)`` and its log-prob, by vLLM's semantics: ``log_softmax(logits /
    temperature)`` in fp64, top-p (the smallest set of most likely tokens whose mass reaches ``top_p``), greedy at
    temperature 0. Computed on the logits' device; the draw is the inverse of each row's cumulative distribution
    at one uniform per row from ``gen`` (a CPU ``torch.Generator`` for every row, a list of one per row, or of one
    per equal block of rows), so the tokens do not depend on the device. Non-finite probabilities are an error."""
    z = logits.double() / max(temperature, 1e-6)  # (n, V)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    probs = (z - lse).exp_()  # one pass of exp: the log-probs are needed at the drawn tokens only
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    if temperature <= 0:
        tok = probs.argmax(-1)
    else:
        n = probs.shape[0]
        if isinstance(gen, torch.Generator):
            u = torch.rand(n, generator=gen, dtype=torch.float64)
        else:  # one generator per row, or per block of rows (a prompt's replies: drawn as if alone)
            per = n // len(gen)
            u = torch.cat([torch.rand(per, generator=g, dtype=torch.float64) for g in gen])
        cdf = probs.cumsum(-1)
        total = cdf[:, -1]
        if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()):
            raise RuntimeError("megatron generator: the next-token probabilities are not finite (non-finite "
                               "logits from the model)")
        tok = torch.searchsorted(cdf, (u.to(probs.device) * total).unsqueeze(-1), right=True).squeeze(-1)
        over = tok >= probs.shape[-1]  # u * total rounded up to total: the row's last token with mass
        if bool(over.any()):
            tok[over] = probs.shape[-1] - 1 - (probs[over].flip(-1) > 0).to(torch.int8).argmax(-1)
    return tok, (z.gather(-1, tok.unsqueeze(-1)) - lse).squeeze(-1)


class MegatronRollout:
    reads_actor_params = True
    needs_sync = False  # it generates with the actor's own parameters
    name = "megatron-fallback"
    use_decode_cache = True
    """feed each drawn token alone through a ``DecodeCache`` where the model allows (tests compare both ways)"""
    max_batch_rows = 64
    """``generate`` samples the replies of prompts of one length together, up to this many rows a batch (1: each
    prompt's replies alone, as before; the tokens drawn are the same either way)"""

    def __init__(self, mesh, actor, cfg: RolloutConfig, announce: bool = True):
        """``announce``: log the fallback's warning (False for a generator that is not the policy's, such as an
        LLM judge's, ``rlhf.rewards.judge``)."""
        self.mesh, self.actor, self.cfg = mesh, actor, cfg
        self.version = 0
        eos = actor.source["hf_config"].get("eos_token_id")
        self.eos_ids = {int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None}
        """every end-of-sequence token the config names (Llama 3 names several), as vLLM stops on each"""
        if mesh.is_rank0 and announce:
            log.warning("=" * 100)
            log.warning("ROLLOUT FALLBACK: vLLM is not available (or --rollout_backend megatron); generating with "
                        "the megatron actor, one forward per token, only prompts of one length batched together. "
                        "Expect it to be slow.")
            log.warning("=" * 100)
        from rlhf.rollout.decode_cache import cache_refusal

        self.cache_refusal = cache_refusal(actor.spec, getattr(actor.module, "config", None), mesh.cp)
        """why ``generate`` feeds whole sequences per token (None: it uses the decode cache)"""
        if mesh.is_rank0:
            log.info("megatron generator: " + (f"whole sequences per token, no decode cache: {self.cache_refusal}"
                                               if self.cache_refusal else
                                               "decode cache (the prompt once, then one token per forward)"))

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        pass

    def sleep(self) -> None:
        pass

    def load_weights(self, weights: Iterable, version: int) -> None:
        self.version = version  # the fallback reads the actor's parameters directly

    def _decode_cache(self, rows: int, length: int):
        """A fresh ``DecodeCache`` for ``rows`` samples of up to ``length`` tokens, or None where the model takes
        whole sequences (``cache_refusal``)."""
        from rlhf.rollout.decode_cache import new_cache

        if not self.use_decode_cache or self.cache_refusal:
            return None
        return new_cache(rows, length)

    def _recorder(self):
        """An MoE actor's routing recorder (``rlhf.models.routing_replay``): the fallback records the experts of
        every token it feeds forward, as vLLM's ``enable_return_routed_experts`` does; None for a dense actor."""
        from rlhf.models.routing_replay import RoutingRecorder, replay_routers

        if not replay_routers(self.actor.module):
            return None
        return RoutingRecorder(self.actor.spec.num_layers, model=self.actor.module)

    @torch.no_grad()
    def _next_token(self, ids: torch.Tensor, temperature: float, top_p: float, gen, recorder=None,
                    last: torch.Tensor | None = None, mm: dict | None = None, cache=None):
        """ids (n, L) -> (token (n,), logprob (n,)) identical on every rank of this DP replica; ``recorder`` (a
        ``RoutingRecorder``) gets the routing of this forward. ``gen``: one ``torch.Generator`` for every row, a
        list of one per row, or of one per equal block of rows; ``last``: each row's last real position (rows
        right-padded: the causal mask keeps the padding out of every real position), default the last column.
        ``mm``: the images of a vision-language prompt (``ImagePrompt.mm``), the same for every row: the tower runs
        in each forward and the 3-D positions are those of the whole sequence so far
        (``rlhf.models.vlm.vision_batch``), as the trainer's. ``cache``: a ``DecodeCache`` holding the tokens before
        ``ids``."""
        from rlhf.data.collate import vision_entries
        from rlhf.models.pipeline import gather_vocab_parallel

        mesh = self.mesh
        mb = {"input_ids": ids} if recorder is None else {"input_ids": ids, "routing_recorder": recorder}
        mb.update(vision_entries([mm] * ids.shape[0], ids) if mm is not None else {})
        if cache is not None:
            mb["inference_context"] = cache
        outs = self.actor.forward([mb])
        result = torch.empty(2, ids.shape[0], dtype=torch.float64)
        if mesh.is_last_stage:
            out = outs[0]["output"]
            if last is None:
                rows = out[:, -1]
            else:
                rows = out[torch.arange(out.shape[0], device=out.device), last.to(out.device)]
            logits = gather_vocab_parallel(rows)[:, : self.actor.spec.vocab_size]
            tok, lp = sample_rows(logits, temperature, top_p, gen)
            result[0], result[1] = tok.double().cpu(), lp.cpu()
        if mesh.pp > 1:
            dist.broadcast(result, src=dist.get_global_rank(mesh.pp_group, mesh.pp - 1), group=mesh.pp_group)
        return result[0].long(), result[1].float()

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int, ignore_eos: bool = False) -> list[Sample]:
        mesh = self.mesh
        per = len(prompts) // mesh.dp
        lo = mesh.dp_rank * per
        mine = list(prompts[lo: lo + per])
        replies: dict[int, list] = {}
        for batch in self._batches(mine, n):
            gens = [torch.Generator().manual_seed(seed * 1_000_003 + lo + i) for i in batch]
            mm = getattr(mine[batch[0]], "mm", None)  # an ``ImagePrompt``'s images (such a prompt is batched alone)
            out = self._sample([mine[i] for i in batch], n, temperature, top_p, max_tokens, gens, ignore_eos, mm)
            replies.update(zip(batch, out))
        local = [Sample(lo + i, list(prompt), row, lps, ended, mm=getattr(prompt, "mm", None), routed_experts=routed)
                 for i, prompt in enumerate(mine) for row, lps, ended, routed in replies[i]]
        keep = mesh.tp_rank == 0 and mesh.pp_rank == 0
        return gather_samples(local if keep else [], mesh)

    def _batches(self, prompts: Sequence, n: int) -> list[list[int]]:
        """The prompts' indices in the batches ``generate`` samples together: prompts of one length (no padding:
        the decode cache's rows share one offset), each with its ``n`` replies, up to ``max_batch_rows`` rows (at
        least one prompt). A prompt with images, and every prompt of an actor whose forwards are collectives over
        the EP group (its ranks must feed the same number of batches), is a batch of its own."""
        alone = self.mesh.ep > 1 and bool(self.actor.spec.num_experts)
        out, by_len = [], {}
        for i, p in enumerate(prompts):
            if alone or getattr(p, "mm", None) is not None:
                out.append([i])
            else:
                by_len.setdefault(len(p), []).append(i)
        per = max(1, self.max_batch_rows // max(n, 1))
        for idx in by_len.values():
            out += [idx[k:k + per] for k in range(0, len(idx), per)]
        return sorted(out)

    def generate_requests(self, requests: Sequence[tuple], with_routing: bool = False) -> list[tuple]:
        """``VLLMRollout.generate_requests``: each DP replica samples a contiguous share, one request at a time
        (its own generator from the request's seed); every rank gets every result, in order. Refused with expert
        parallelism (a replica's forwards are collectives over the EP group; shares differ in length)."""
        mesh = self.mesh
        lo, hi = mesh.dp_rank * len(requests) // mesh.dp, (mesh.dp_rank + 1) * len(requests) // mesh.dp
        local: list[Sample] = []
        for i, (prompt, max_tokens, temperature, top_p, seed) in enumerate(requests[lo:hi]):
            gen = torch.Generator().manual_seed(seed)
            ((row, lps, ended, routed),), = self._sample([prompt], 1, temperature, top_p, max_tokens, [gen], False)
            local.append(Sample(lo + i, [], row, lps, ended, routed_experts=routed if with_routing else None))
        keep = mesh.tp_rank == 0 and mesh.pp_rank == 0
        return [(s.response_ids, s.logprobs, s.finished) + ((s.routed_experts,) if with_routing else ())
                for s in gather_samples(local if keep else [], mesh)]

    def _sample(self, prompts, n: int, temperature: float, top_p: float, max_tokens: int, gens, ignore_eos: bool,
                mm: dict | None = None):
        """``n`` replies to each of ``prompts`` (all of one length), drawn by its own generator of ``gens``: per
        prompt, ``(token ids, log-probs, ended by EOS, routing)`` each, cut after EOS; routing (an MoE actor's; else
        None): the experts of the prompt and response tokens fed forward, (P + R - 1, layers, top_k) expert ids, each
        token's from the forward that first fed it."""
        eos = set() if ignore_eos else self.eos_ids
        prompt = list(prompts[0])
        ids = torch.tensor([list(p) for p in prompts for _ in range(n)], dtype=torch.long)  # (k n, P)
        gen = gens[0] if len(gens) == 1 else gens  # several: one per prompt's block of n rows
        tokens, lps = [], []
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        recorder, routed = self._recorder(), []
        cache = self._decode_cache(ids.shape[0], len(prompt) + max_tokens)
        for _ in range(max_tokens):
            fed = ids.shape[1] - sum(r.shape[1] for r in routed)
            if cache is None:
                tok, lp = self._next_token(ids, temperature, top_p, gen, recorder, mm=mm)
            else:  # the tokens the cache does not hold yet: the prompt, then the last drawn token
                tok, lp = self._next_token(ids[:, cache.sequence_len_offset:], temperature, top_p, gen, recorder,
                                           mm=mm, cache=cache)
                cache.advance(ids.shape[1] - cache.sequence_len_offset)
            if recorder is not None:  # the positions this forward fed for the first time
                from rlhf.models.routing_replay import merge_stages

                routed.append(merge_stages(recorder.parts.pop()[:, -fed:], self.mesh))  # PP: every stage's layers
            tokens.append(tok)
            lps.append(lp)
            done |= torch.tensor([int(t) in eos for t in tok.tolist()], dtype=torch.bool)
            ids = torch.cat([ids, tok.unsqueeze(1)], dim=1)
            if self._all_done(done):
                break
        toks, lpt = torch.stack(tokens, 1), torch.stack(lps, 1)  # (n, R)
        routing = (torch.cat(routed, 1).long() - 1) if routed else None  # (n, P + R - 1, layers, K) expert ids
        out = []
        for k in range(ids.shape[0]):
            row = toks[k].tolist()
            end = next((i + 1 for i, t in enumerate(row) if t in eos), None)
            cut = end or len(row)
            r = None if routing is None else routing[k, : len(prompt) + cut - 1].to(torch.int16).numpy()
            out.append((row[:cut], lpt[k, :cut].tolist(), end is not None, r))
        return [out[j * n:(j + 1) * n] for j in range(len(prompts))]

    @torch.no_grad()
    def partial_round(self, mine: list, need: int, *, temperature: float, top_p: float, max_tokens: int,
                      version: int, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                      due: Sequence[bool] | None = None) -> tuple[int, int]:
        """One partial-rollout round (``rlhf.rollout.partial.generate_partial``) over this DP replica's groups
        ``mine`` (lists of ``PartialSample``, updated in place): every unfinished sample gains one token per
        forward, the replica's unfinished samples right-padded into one batch, until ``need`` of its groups are
        whole (the rest is left unfinished: vLLM's abort) or nothing is left. A carried sample continues from
        prompt + prefix with a fresh stream (``PartialSample.round_seed``); a new one draws with its own seed. An MoE
        actor's samples that finish get the routing of this round's forwards, each position's from the forward that
        first fed it (the prefix re-fed at this version, as vLLM's prefill of a continued request). ``due``: per
        group, whether the round must not stop before it is whole (the staleness bound). Returns (aborted samples,
        generated tokens)."""
        stops = (set() if ignore_eos else set(self.eos_ids)) | {int(t) for t in stop_token_ids}
        left = [sum(not s.done for s in g) for g in mine]
        whole = sum(x == 0 for x in left)
        due = list(due) if due is not None else [False] * len(mine)
        due_left = sum(d and x > 0 for d, x in zip(due, left))
        active = [(gi, s, torch.Generator().manual_seed(s.round_seed(version)), [])
                  for gi, g in enumerate(mine) for s in g if not s.done]
        recorder, generated = self._recorder(), 0
        while True:
            idle = (whole >= need and not due_left) or not active
            if self._all_done(torch.tensor(idle)):  # with expert parallelism the EP ranks stop together
                break
            if idle:  # this replica is done, an EP peer is not: its forwards are collectives, so feed one token
                self.actor.forward([{"input_ids": torch.zeros(1, 1, dtype=torch.long)}])
                continue
            rows = [list(s.prompt_ids) + list(s.response_ids) for _, s, _, _ in active]
            lens = torch.tensor([len(r) for r in rows])
            ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)
            for j, r in enumerate(rows):
                ids[j, : len(r)] = torch.tensor(r)
            tok, lp = self._next_token(ids, temperature, top_p, [a[2] for a in active], recorder, last=lens - 1)
            if recorder is not None:
                from rlhf.models.routing_replay import merge_stages

                fed = merge_stages(recorder.parts.pop(), self.mesh)  # (n, L, layers, K) ids + 1
            for j, (gi, s, _, routed) in enumerate(active):
                if recorder is not None:  # a sample's first forward of the round feeds all of it, later ones a token
                    routed.append(fed[j, (int(lens[j]) - 1 if routed else 0): int(lens[j])])
                t = int(tok[j])
                s.response_ids.append(t)
                s.logprobs.append(float(lp[j]))
                s.versions.append(version)
                generated += 1
                if t in stops or len(s.response_ids) >= max_tokens:
                    s.done, s.finished = True, t in stops
                    if routed:
                        s.routed_experts = (torch.cat(routed).long() - 1).to(torch.int16).numpy()
                    left[gi] -= 1
                    whole += left[gi] == 0
                    due_left -= due[gi] and left[gi] == 0
            active = [a for a in active if not a[1].done]
        return len(active), generated

    def _all_done(self, done: torch.Tensor) -> bool:
        """Every sample ended. With expert parallelism each forward is a collective over the EP group, so its
        ranks stop together (tokens past an EOS are cut below)."""
        stop = torch.tensor([1.0 if bool(done.all()) else 0.0])
        if self.mesh.ep > 1 and self.actor.spec.num_experts:
            dist.all_reduce(stop, op=dist.ReduceOp.MIN, group=self.mesh.ep_group)
        return bool(stop.item())

    def close(self) -> None:
        pass
