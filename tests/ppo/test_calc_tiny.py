"""The tiny-model calculator task (rlhf/demo/calc_task.py, ``--tiny``): its SFT corpus must show the model the very
token sequence the agent rollout builds, or the SFT habits (call, then copy the calculator's number) would not
carry over to the trajectories RL trains on."""
import asyncio
import os

import pytest


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from rlhf.demo.calc_task import tiny_corpus
    from rlhf.models.tiny import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("calc_tok")), vocab_size=300, seed=0, texts=tiny_corpus())


class Replies:
    """An ``llm_engine`` that answers each turn with the next given token ids and records each turn's context."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.contexts = tok, list(replies), []

    async def generate(self, ids, params, multi_modal_data=None):
        from rlhf.agents.environment import Completion, RequestOutput, _Logprob

        self.contexts.append(list(ids))
        toks = self.replies.pop(0)
        text = self.tok.decode(toks, skip_special_tokens=True)  # as vLLM's .text
        return RequestOutput([Completion(toks, text, [{t: _Logprob(-0.5)} for t in toks], "stop")])


def test_sft_rows_are_the_rollouts_contexts_token_for_token(tiny_tok):
    from helpers import REPO

    from rlhf.agents import SamplingParams, load_agent_executor
    from rlhf.demo.calc_task import TOOL_FRACTION, make_split, tiny_prompt, tiny_sft_rows

    def ids(text):
        return tiny_tok(text=text, add_special_tokens=False)["input_ids"]

    rows = tiny_sft_rows(seed=0, n=400)
    firsts, seconds = rows[0::2], rows[1::2]
    calls = [r for r in firsts if "<calc>" in r["output"]]
    assert abs(len(calls) / len(firsts) - TOOL_FRACTION) < 0.07  # 400 draws: 3 sigma of a binomial is 0.065
    guesses = [r for r in firsts if "<calc>" not in r["output"]]
    assert all(int(r["output"]) != eval(r["input"].replace(" times ", "*").rstrip(" =")) for r in guesses)
    ex = load_agent_executor(os.path.join(REPO, "rlhf", "demo", "calc_agent.py"))
    for first, second in list(zip(firsts, seconds))[:20]:
        a, b = (int(x) for x in first["input"].split()[::2][:2])
        call = ids(f" <calc>{a}*{b}</calc>") + [tiny_tok.eos_token_id]
        llm = Replies(tiny_tok, [call, ids(str(a * b)) + [tiny_tok.eos_token_id]])
        prompt = tiny_prompt(a, b)
        out = asyncio.run(ex.execute(prompt=prompt, label=str(a * b), sampling_params=SamplingParams(max_tokens=12),
                                     max_length=64, hf_tokenizer=tiny_tok, llm_engine=llm, prompt_ids=ids(prompt)))
        assert out["reward"] == 1.0 and out["turns"] == 2
        # the second turn's context is the SFT row's input, token for token, and its answer is the row's output
        assert llm.contexts[1] == ids(second["input"]), (tiny_tok.convert_ids_to_tokens(llm.contexts[1]),
                                                         tiny_tok.convert_ids_to_tokens(ids(second["input"])))
        assert second["output"] == str(a * b) and first["input"] == prompt
    # negative control: without the turn's eos in the row, the contexts differ
    assert ids(second["input"].replace("</s>", "")) != llm.contexts[1]
    train, held = make_split(0, 64, 16, tiny_prompt)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(int(r["answer"]) == eval(r["prompt"].replace(" times ", "*").rstrip(" =")) for r in train)
