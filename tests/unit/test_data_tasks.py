"""The toy task: deterministic prompts, an answer that depends on the prompt, and a learnable reward."""

import itertools
import random
import re
import statistics

import pytest
import torch

from forge.data import TOY_ALPHABET, ToyTask, get_reward, toy_partial_reward
from forge.types import Prompt


def test_same_seed_gives_same_prompts():
    """Two tasks with one seed produce identical prompt streams."""
    assert ToyTask(seed=3).take(20) == ToyTask(seed=3).take(20)


def test_different_seeds_give_different_prompts():
    """Seeds 0 and 1 produce different prompt texts."""
    assert [p.text for p in ToyTask(seed=0).take(20)] != [p.text for p in ToyTask(seed=1).take(20)]


def test_prompt_is_addressable_by_index_and_matches_iteration():
    """task[i] is the i-th prompt the iterator yields, so a stream can be split by index."""
    task = ToyTask(seed=5)
    assert list(itertools.islice(task, 10)) == [task[i] for i in range(10)]
    assert task.take(3, start=7) == [task[7], task[8], task[9]]


def test_answer_is_the_prompt_digits_reversed():
    """'371=' has the answer '173'; prompts are three digits then '='."""
    for p in ToyTask(seed=0).take(50):
        assert isinstance(p, Prompt)
        assert re.fullmatch(r"\d{3}=", p.text)
        assert p.answer == p.text[:-1][::-1]
        assert p.meta["reward"] == "toy"


def test_prompts_and_answers_stay_within_the_toy_alphabet():
    """A character tokenizer over TOY_ALPHABET can encode every prompt and answer."""
    for p in ToyTask(seed=0, min_digits=1, max_digits=6).take(100):
        assert set(p.text + p.answer) <= set(TOY_ALPHABET)


def test_variable_length_prompts_cover_the_range():
    """min_digits..max_digits are all used."""
    lengths = {len(p.answer) for p in ToyTask(seed=0, min_digits=2, max_digits=4).take(200)}
    assert lengths == {2, 3, 4}


def test_num_prompts_bounds_iteration():
    """num_prompts makes a finite dataset; None is an endless stream."""
    assert len(list(ToyTask(seed=0, num_prompts=7))) == 7
    assert len(list(itertools.islice(ToyTask(seed=0), 1000))) == 1000


@pytest.mark.parametrize("kwargs", [dict(min_digits=0), dict(min_digits=4, max_digits=3), dict(num_prompts=-1)])
def test_invalid_task_arguments_are_rejected(kwargs):
    """Impossible lengths or counts raise ValueError naming the values."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ToyTask(seed=0, **kwargs)


# ---------------------------------------------------------------------------------------------
# The reward on this task


def test_correct_answer_scores_one_and_trailing_text_after_a_space_is_ignored():
    """The first word is the answer: '173' and '173 xyz' both score 1.0."""
    p = Prompt("p", "371=", "173")
    assert toy_partial_reward(p, "173") == 1.0
    assert toy_partial_reward(p, " 173 xyz") == 1.0
    assert get_reward("toy") is toy_partial_reward


def test_partial_credit_per_position_and_for_length():
    """0.9 * matching positions / n + 0.1 if the length is right."""
    p = Prompt("p", "371=", "173")
    assert toy_partial_reward(p, "170") == pytest.approx(0.9 * 2 / 3 + 0.1)
    assert toy_partial_reward(p, "1734") == pytest.approx(0.9)
    assert toy_partial_reward(p, "73") == pytest.approx(0.0)
    assert toy_partial_reward(p, "") == 0.0


def test_random_responses_get_small_but_varied_rewards():
    """A random model's samples give groups with reward variance, so GRPO has a signal at step 0."""
    rng = random.Random(0)
    prompts = ToyTask(seed=0).take(64)

    def random_text():
        return "".join(rng.choice(TOY_ALPHABET) for _ in range(rng.randint(1, 6)))

    groups = [[toy_partial_reward(p, random_text()) for _ in range(8)] for p in prompts]
    mean = statistics.mean(r for g in groups for r in g)
    assert 0.0 < mean < 0.2
    assert sum(len(set(g)) > 1 for g in groups) > len(groups) // 2


@pytest.mark.parametrize("constant", ["555", "000", "123", "5", "55555"])
def test_a_constant_answer_scores_poorly(constant):
    """The answer depends on the prompt: any fixed response averages well under 0.3."""
    prompts = ToyTask(seed=0).take(300)
    assert statistics.mean(toy_partial_reward(p, constant) for p in prompts) < 0.3


# ---------------------------------------------------------------------------------------------
# Learnability: a tiny random-init transformer learns the task with grpo_loss in 150 steps.


class _TinyGPT(torch.nn.Module):
    """2-layer, 64-wide causal transformer over TOY_ALPHABET + an end token."""

    def __init__(self, vocab: int, d: int = 64, layers: int = 2, ctx: int = 16):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(ctx, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(T)
        return self.head(self.blocks(self.tok(idx) + self.pos(torch.arange(T)), mask=causal, is_causal=True))


@pytest.mark.slow
def test_tiny_model_learns_toy_task_with_grpo_in_150_steps():
    """Reward rises from < 0.15 to > 0.85 (group 8, 16 prompts/step, beta 0.04): the task is learnable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~10 s alone; more threads only add contention on a busy CPU
    try:
        first, last = _train_toy_task_with_grpo(steps=150)
    finally:
        torch.set_num_threads(threads)
    assert first < 0.15
    assert last > 0.85


def _train_toy_task_with_grpo(steps: int, seed: int = 0) -> tuple[float, float]:
    """Single-process GRPO on the toy task; mean reward of the first and last 10 steps."""
    import copy

    from forge.losses import group_advantages, grpo_loss

    torch.manual_seed(seed)
    eos = len(TOY_ALPHABET)
    stoi = {c: i for i, c in enumerate(TOY_ALPHABET)}
    model = _TinyGPT(len(TOY_ALPHABET) + 1)
    ref = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    task, group, per_step, new_tokens = ToyTask(seed=seed), 8, 16, 6
    history = []
    for step in range(steps):
        prompts = task.take(per_step, start=step * per_step)
        ids = torch.tensor([[stoi[c] for c in p.text] for p in prompts]).repeat_interleave(group, 0)  # [N, P]
        plen = ids.shape[1]
        with torch.no_grad():  # sample; positions after the end token are padding
            done = torch.zeros(len(ids), dtype=torch.bool)
            for _ in range(new_tokens):
                nxt = torch.multinomial(torch.softmax(model(ids)[:, -1], -1), 1).squeeze(1)
                nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                ids = torch.cat([ids, nxt[:, None]], 1)
                done |= nxt == eos
        resp = ids[:, plen:]  # [N, T]
        is_eos = (resp == eos).int()
        mask = (is_eos.cumsum(1) - is_eos) == 0  # tokens up to and including the first end token
        texts = ["".join(TOY_ALPHABET[t] for t in itertools.takewhile(eos.__ne__, row.tolist())) for row in resp]
        rewards = torch.tensor([toy_partial_reward(prompts[i // group], t) for i, t in enumerate(texts)])
        adv = torch.cat([group_advantages(g) for g in rewards.view(per_step, group)])

        def logprobs(m, ids=ids, plen=plen):
            lp = torch.log_softmax(m(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            return lp[:, plen - 1 :]  # [N, T]

        lp = logprobs(model)
        with torch.no_grad():
            ref_lp = logprobs(ref)
        loss, _ = grpo_loss(lp, lp.detach(), ref_lp, adv, mask, beta=0.04)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(rewards.mean().item())
    return statistics.mean(history[:10]), statistics.mean(history[-10:])
