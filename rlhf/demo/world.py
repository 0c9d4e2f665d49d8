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

The tools world (`demo.task: tools`) gives each user liked adjectives (a record's `liked` column)
that only the `preferences` tool (rlhf/demo/tools.py) tells; its gold, `gold_tool_score`, rewards
the liked ones and penalises any other, so an answer that never sees the tool's result can only
guess (3 of 30). Its demonstrations are chat transcripts (`messages`: user, assistant, tool roles)
of which `tool_call_rate` call the tool before answering with liked adjectives; its preference pairs
and prompts are the describe world's (the prompts with `liked` added).

The code world (`demo.task: code`, rlhf/demo/code.py) asks for a one-line function f(x); each prompt
record carries its `tests` (asserts a reward function runs in the sandbox), and its gold,
`gold_code_score`, reads the answer and checks it on inputs the tests do not show.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

from rlhf.demo.code import code_records, gold_code_score
from rlhf.demo.locations import DemoWorldConfig
from rlhf.demo.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_NAME, call_text, liked_text
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


def _chat_template(more_roles: str = "") -> str:
    """The demo's chat template, with `more_roles` as further `{% elif %}` branches of the role."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
        "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
        "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
        + more_roles
        + "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


# Rendering of a conversation; the same template is stored in the tokenizer, so the pipeline
# only ever meets it through `tokenizer.apply_chat_template`.
CHAT_TEMPLATE = _chat_template()
# The tools world's: a tool's answer follows the assistant's call as `<|tool|>...` (no end-of-turn
# token: the assistant's next turn follows). Only appends, so a conversation's rendering is a prefix
# of its rendering with one more message (multi-turn training and episodes rely on it).
TOOLS_CHAT_TEMPLATE = _chat_template("{% elif message['role'] == 'tool' %}<|tool|>{{ message['content'] }}")
SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
TOOL_TOKENS = ("<|tool|>", TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


# --- the hidden gold preference -------------------------------------------------------------

_WORD = re.compile(r"[a-z]+")


def gold_score(prompt: str, response: str) -> float:
    """Hidden quality of a response: +1 per distinct pleasant adjective, -1 per distinct
    unpleasant one, +1 for naming the asked-about subject, -1 for naming another subject
    instead, and -0.5 per word beyond ten."""
    words = _WORD.findall(response.lower())
    distinct = set(words)
    return float(len(distinct & set(POSITIVE)) - len(distinct & set(NEGATIVE))) + _subject_and_length(prompt, words)


def gold_tool_score(prompt: str, liked: str, response: str) -> float:
    """Hidden quality of a tools-world response for a user who likes `liked` (space-separated
    adjectives): +1 per distinct liked adjective, -1 per distinct adjective that is not liked, -1 for
    none at all (a description says something), +1 for naming the asked-about subject, -1 for naming
    another subject instead, -0.5 per word beyond ten."""
    words = _WORD.findall(response.lower())
    likes = set(liked.split())
    adjectives = set(words) & set(ADJECTIVES)
    score = float(len(adjectives & likes) - len(adjectives - likes)) - (0.0 if adjectives else 1.0)
    return score + _subject_and_length(prompt, words)


def _subject_and_length(prompt: str, words: list[str]) -> float:
    """Both worlds' gold beside the adjectives: +1 for naming the asked-about subject, -1 for naming
    another subject instead, -0.5 per word beyond ten (all multiples of 0.5: exact in any order)."""
    asked = {w for w in _WORD.findall(prompt.lower()) if w in SUBJECTS}
    named = set(words) & set(SUBJECTS)
    score = 1.0 if named & asked else -1.0 if named else 0.0
    return score - 0.5 * max(0, len(words) - 10)


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


def _response(rng: random.Random, subject: str, off_subject_rate: float, pool: tuple[str, ...] = ADJECTIVES) -> str:
    """A sentence of 1 to 3 adjectives of `pool` about the subject (sometimes, wrongly, another one)."""
    if rng.random() < off_subject_rate:
        subject = rng.choice([s for s in SUBJECTS if s != subject])
    adjectives = rng.sample(pool, rng.randint(1, 3))
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
    if cfg.task == "code":
        return code_records(cfg, _unique)
    return _tools_records(cfg) if cfg.task == "tools" else _describe_records(cfg)


def _describe_records(cfg: DemoWorldConfig) -> dict[str, list[dict]]:
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


def _transcript(rng: random.Random, cfg: DemoWorldConfig) -> dict:
    """A tools-world demonstration: a chat transcript that calls the tool (`tool_call_rate` of them)
    and answers with liked adjectives, or answers at once with random ones; and its user's `liked`."""
    subject, prompt = _prompt(rng)
    liked = tuple(rng.sample(ADJECTIVES, 3))
    messages = [{"role": "user", "content": prompt}]
    if rng.random() < cfg.tool_call_rate:
        messages += [{"role": "assistant", "content": call_text(subject)},
                     {"role": "tool", "name": TOOL_NAME, "content": liked_text(" ".join(liked))},
                     {"role": "assistant", "content": _response(rng, subject, cfg.off_subject_rate, liked)}]
    else:
        messages.append({"role": "assistant", "content": _response(rng, subject, cfg.off_subject_rate)})
    return {"messages": messages, "liked": " ".join(liked)}


def _tools_records(cfg: DemoWorldConfig) -> dict[str, list[dict]]:
    """The describe world's preference pairs and prompts (each prompt with its user's `liked`
    adjectives), and chat transcripts as demonstrations; drawn from their own random stream."""
    records = _describe_records(cfg)
    rng = random.Random(f"tools:{cfg.seed}")
    sft = _unique(rng, cfg.n_sft + cfg.n_sft_eval, lambda: _transcript(rng, cfg),
                  lambda r: json.dumps(r["messages"]))
    for name in ("prompts", "prompts_eval"):
        records[name] = [{"prompt": r["prompt"], "liked": " ".join(rng.sample(ADJECTIVES, 3))} for r in records[name]]
    return records | {"sft": sft[: cfg.n_sft], "sft_eval": sft[cfg.n_sft :]}


def _corpus(records: dict[str, list[dict]]) -> list[str]:
    """The tokenizer's training text: the prompts, the demonstrations and the preference pairs."""
    corpus = [r["prompt"] for r in records["prompts"]]
    corpus += [r["prompt"] + " " + r["response"] if "response" in r else " ".join(m["content"] for m in r["messages"])
               for r in records["sft"]]
    corpus += [r["chosen"] + " " + r["rejected"] for r in records["preferences"]]
    return corpus


# --- tokenizer and model --------------------------------------------------------------------


def build_tokenizer(corpus: list[str], cfg: DemoWorldConfig):
    """Byte-level BPE trained on the task corpus, with distinct pad/bos/eos, left padding and
    the chat template (the tools world's: with the tool role and the tool-call markers as special
    tokens). No special tokens are added implicitly: the chat template places them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tools = cfg.task == "tools"
    roles = [*ROLE_TOKENS, *TOOL_TOKENS] if tools else list(ROLE_TOKENS)
    specials = [SPECIAL_TOKENS["pad"], SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"], *roles]
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
        additional_special_tokens=roles,
        padding_side="left",
        chat_template=TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
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

    tokenizer = build_tokenizer(_corpus(records), cfg)
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
    return [next(m["content"] for m in reversed(json.loads(messages)) if m["role"] == "user")
            for messages in prompt_messages]


def _golds(prompts: list[str], responses: list[str], liked: list[str] | None, code: bool = False) -> list[float]:
    """Each response's gold: `gold_score`, or with users' `liked` adjectives the tools world's `gold_tool_score`,
    or in the code world (`code`) `gold_code_score`."""
    if code:
        return [gold_code_score(p, r) for p, r in zip(prompts, responses, strict=True)]
    if liked is None:
        return [gold_score(p, r) for p, r in zip(prompts, responses, strict=True)]
    return [gold_tool_score(p, k, r) for p, k, r in zip(prompts, liked, responses, strict=True)]


def mean_gold_reward(prompt_messages: list[str], responses: list[str], liked: list[str] | None = None) -> float:
    """Mean gold reward of responses to conversations given as JSON messages (a PPO iteration's episodes);
    with `liked` (each prompt's user's liked adjectives, space-separated), the tools world's gold."""
    golds = _golds(last_user_turns(prompt_messages), responses, liked)
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


def gold_comparison(prompts: list[str], responses: list[str], baseline: list[str],
                    liked: list[str] | None = None, code: bool = False) -> dict[str, float]:
    """Gold reward of `responses` and of `baseline`, and the share of prompts where the response
    beats the baseline under the gold function (ties count half), with its standard error over prompts;
    with `liked`, the tools world's gold (`gold_tool_score`); with `code`, the code world's."""
    ours = _golds(prompts, responses, liked, code)
    theirs = _golds(prompts, baseline, liked, code)
    wins, wins_se = win_rate(ours, theirs, prompts)
    n = max(len(ours), 1)
    return {"eval/gold_reward": sum(ours) / n, "eval/gold_reward_sft": sum(theirs) / n, "eval/gold_win_rate": wins,
            "eval/gold_win_rate_se": wins_se}


def judge_evaluation(table) -> dict[str, float]:
    """`gold_comparison` of a policy's held-out evaluation table (the stages' `evaluate`: columns
    `prompt_messages`, `policy_response`, `sft_response`): the policy against the SFT responses. A table
    with a `liked` column (the tools world's prompts) is judged by the tools world's gold: the responses
    are then the final answers, without the tool calls and results before them. One with a `tests` column
    (the code world's prompts) by the code world's."""
    liked = list(table["liked"]) if "liked" in table else None
    return gold_comparison(last_user_turns(table["prompt_messages"]), list(table["policy_response"]),
                           list(table["sft_response"]), liked, code="tests" in table)
