"""The embedded demo world: a tiny, fully local stand-in for a hub model and its data.

Task: a user asks about a subject ("Describe the cat."); the assistant answers with one
sentence of adjectives about it ("The cat is warm and noisy."). A hidden gold function
prefers answers that talk about the subject that was asked about and use pleasant, distinct
adjectives. The SFT demonstrations pick adjectives at random, so an SFT policy is
indifferent to sentiment: it learns the format and to name the right subject. Preference
pairs are labelled by the gold function through a Bradley-Terry coin (realistic label
noise), so a reward model can learn what PPO should then optimise.

Everything is built deterministically from a seed and saved as ordinary Hugging Face folders
and JSONL files; the pipeline treats the result exactly like a hub model and user data.
`gold_score` is for labelling pairs and for evaluation only: no training stage imports it.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

from rlhf.demo_locations import DemoWorldConfig
from rlhf.evaluation import win_rate

SUBJECTS = ("cat", "dog", "park", "city", "movie", "book", "song", "garden", "river", "house", "train", "coffee")
POSITIVE = ("good", "great", "lovely", "bright", "happy", "kind", "warm", "calm", "fresh", "sweet")
NEGATIVE = ("bad", "awful", "dull", "sad", "cold", "rude", "ugly", "noisy", "stale", "bitter")
NEUTRAL = ("big", "small", "old", "new", "red", "blue", "round", "tall", "long", "plain")
ADJECTIVES = POSITIVE + NEGATIVE + NEUTRAL
PROMPT_TEMPLATES = (
    "Describe {} {}.", "Tell me about {} {}.", "What do you think of {} {}?",
    "Say something about {} {}.", "How is {} {}?", "Give me your view of {} {}.",
)
DETERMINERS = ("the", "my", "your", "this", "that", "our")
PROMPT_ENDINGS = ("", " Please.", " Be brief.")

# Rendering of a conversation; the same template is stored in the tokenizer, so the pipeline
# only ever meets it through `tokenizer.apply_chat_template`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")


# --- the hidden gold preference -------------------------------------------------------------

_WORD = re.compile(r"[a-z]+")


def gold_score(prompt: str, response: str) -> float:
    """Hidden quality of a response: +1 per distinct pleasant adjective, -1 per distinct
    unpleasant one, +1 for naming the asked-about subject, -1 for naming another subject
    instead, and -0.5 per word beyond ten."""
    asked = {w for w in _WORD.findall(prompt.lower()) if w in SUBJECTS}
    words = _WORD.findall(response.lower())
    distinct = set(words)
    score = float(len(distinct & set(POSITIVE)) - len(distinct & set(NEGATIVE)))
    named = distinct & set(SUBJECTS)
    if named & asked:
        score += 1.0
    elif named:
        score -= 1.0
    score -= 0.5 * max(0, len(words) - 10)
    return score


def gold_prefers(prompt: str, a: str, b: str) -> float:
    """1.0 when the gold function prefers a, 0.0 when b, 0.5 on a tie."""
    ga, gb = gold_score(prompt, a), gold_score(prompt, b)
    return 1.0 if ga > gb else 0.0 if ga < gb else 0.5


# --- sampling -------------------------------------------------------------------------------


def _prompt(rng: random.Random) -> tuple[str, str]:
    subject = rng.choice(SUBJECTS)
    return subject, rng.choice(PROMPT_TEMPLATES).format(rng.choice(DETERMINERS), subject) + rng.choice(PROMPT_ENDINGS)


def _distinct_prompts(rng: random.Random, n: int) -> list[str]:
    every = [t.format(d, s) + e
             for t in PROMPT_TEMPLATES for d in DETERMINERS for s in SUBJECTS for e in PROMPT_ENDINGS]
    if n > len(every):
        raise ValueError(f"the demo world has {len(every)} distinct prompts; {n} were asked for")
    return rng.sample(every, n)


def _response(rng: random.Random, subject: str, off_subject_rate: float) -> str:
    if rng.random() < off_subject_rate:
        subject = rng.choice([s for s in SUBJECTS if s != subject])
    adjectives = rng.sample(ADJECTIVES, rng.randint(1, 3))
    if len(adjectives) == 1:
        described = adjectives[0]
    else:
        described = ", ".join(adjectives[:-1]) + " and " + adjectives[-1]
    return f"The {subject} is {described}."


def _sample_pair(rng: random.Random, cfg: DemoWorldConfig) -> dict:
    """A pair of two different-quality responses, labelled by a noisy gold annotator."""
    subject, prompt = _prompt(rng)
    while True:
        a = _response(rng, subject, cfg.off_subject_rate * 2)
        b = _response(rng, subject, cfg.off_subject_rate * 2)
        ga, gb = gold_score(prompt, a), gold_score(prompt, b)
        if ga != gb:
            break
    p_a = 1.0 / (1.0 + math.exp(-(ga - gb) / cfg.label_temperature))
    chosen, rejected = (a, b) if rng.random() < p_a else (b, a)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _unique(rng: random.Random, n: int, make, key) -> list[dict]:
    """n records with distinct keys (the data contracts reject duplicates)."""
    seen, out = set(), []
    while len(out) < n:
        record = make()
        if key(record) not in seen:
            seen.add(key(record))
            out.append(record)
    return out


def build_records(cfg: DemoWorldConfig) -> dict[str, list[dict]]:
    """All demo data sets, split so that no held-out record also appears in training."""
    rng = random.Random(cfg.seed)

    def sft_record() -> dict:
        subject, prompt = _prompt(rng)
        return {"prompt": prompt, "response": _response(rng, subject, cfg.off_subject_rate)}

    sft = _unique(rng, cfg.n_sft + cfg.n_sft_eval, sft_record, lambda r: (r["prompt"], r["response"]))
    pairs = _unique(
        rng, cfg.n_pairs + cfg.n_pairs_eval, lambda: _sample_pair(rng, cfg), lambda r: tuple(r.values())
    )
    prompts = [{"prompt": p} for p in _distinct_prompts(rng, cfg.n_prompts + cfg.n_prompts_eval)]
    return {
        "sft": sft[: cfg.n_sft],
        "sft_eval": sft[cfg.n_sft :],
        "preferences": pairs[: cfg.n_pairs],
        "preferences_eval": pairs[cfg.n_pairs :],
        "prompts": prompts[: cfg.n_prompts],
        "prompts_eval": prompts[cfg.n_prompts :],
    }


# --- tokenizer and model --------------------------------------------------------------------


def build_tokenizer(corpus: list[str], cfg: DemoWorldConfig):
    """Byte-level BPE trained on the task corpus, with distinct pad/bos/eos, left padding and
    the chat template. No special tokens are added implicitly: the chat template places them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [SPECIAL_TOKENS["pad"], SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"], *ROLE_TOKENS]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=cfg.max_position_embeddings,
    )


def build_model(tokenizer, cfg: DemoWorldConfig):
    """A tiny, untrained Llama-style causal LM sized for two CPU cores."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=32,
    )
    return model


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def build_world(root: Path, cfg: DemoWorldConfig = DemoWorldConfig()) -> Path:
    """Build the world into `root/<fingerprint>` once and return that folder.

    The folder is written under a temporary name and renamed at the end, so a crash never
    leaves a half-built world that a later run would trust.
    """
    target = Path(root) / cfg.fingerprint()
    if (target / "world.json").exists():
        return target
    staging = target.with_name(target.name + f".tmp{random.randrange(1 << 30)}")
    staging.mkdir(parents=True)
    records = build_records(cfg)
    for name, rows in records.items():
        _write_jsonl(staging / f"{name}.jsonl", rows)

    corpus = [r["prompt"] for r in records["prompts"]]
    corpus += [r["prompt"] + " " + r["response"] for r in records["sft"]]
    corpus += [r["chosen"] + " " + r["rejected"] for r in records["preferences"]]
    tokenizer = build_tokenizer(corpus, cfg)
    model = build_model(tokenizer, cfg)
    model.save_pretrained(staging / "model", safe_serialization=True)
    tokenizer.save_pretrained(staging / "model")
    (staging / "world.json").write_text(json.dumps({"config": cfg.model_dump()}, indent=2))
    try:
        staging.rename(target)
    except OSError:  # another process finished the same world first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def last_user_turns(prompt_messages: list[str]) -> list[str]:
    """The demo world's prompt in each conversation (JSON messages): its last user turn."""
    return [json.loads(messages)[-1]["content"] for messages in prompt_messages]


def mean_gold_reward(prompt_messages: list[str], responses: list[str]) -> float:
    """Mean gold reward of responses to conversations given as JSON messages (a PPO iteration's episodes)."""
    golds = [gold_score(p, r) for p, r in zip(last_user_turns(prompt_messages), responses, strict=True)]
    return sum(golds) / max(len(golds), 1)


def gold_accuracy(prompts: list[str], chosen: list[str], rejected: list[str],
                  score_chosen: list[float], score_rejected: list[float]) -> float:
    """Share of pairs, among those the gold function does not tie, where the higher-scored
    response is the one the noise-free gold function prefers."""
    hits, counted = 0, 0
    for prompt, a, b, sa, sb in zip(prompts, chosen, rejected, score_chosen, score_rejected, strict=True):
        preference = gold_prefers(prompt, a, b)
        if preference == 0.5:
            continue
        counted += 1
        hits += (sa > sb) == (preference == 1.0)
    return hits / counted if counted else float("nan")


def gold_comparison(prompts: list[str], responses: list[str], baseline: list[str]) -> dict[str, float]:
    """Gold reward of `responses` and of `baseline`, and the share of prompts where the response
    beats the baseline under the gold function (ties count half), with its standard error over prompts."""
    ours = [gold_score(p, r) for p, r in zip(prompts, responses, strict=True)]
    theirs = [gold_score(p, r) for p, r in zip(prompts, baseline, strict=True)]
    wins, wins_se = win_rate(ours, theirs, prompts)
    n = max(len(ours), 1)
    return {"eval/gold_reward": sum(ours) / n, "eval/gold_reward_sft": sum(theirs) / n, "eval/gold_win_rate": wins,
            "eval/gold_win_rate_se": wins_se}


def judge_evaluation(table) -> dict[str, float]:
    """`gold_comparison` of a policy's held-out evaluation table (the stages' `evaluate`: columns
    `prompt_messages`, `policy_response`, `sft_response`): the policy against the SFT responses."""
    return gold_comparison(last_user_turns(table["prompt_messages"]), list(table["policy_response"]),
                           list(table["sft_response"]))
