"""A real model's calculator transcripts, rendered by its chat template as an agent's episode lays them out.

The tool warm-start (`tasks/tool_warmstart.py`) teaches a chat model the calls that
`examples/agents/calculator_agent.py` makes through the agent endpoint. Each transcript is the token
sequence that endpoint would record for the episode (agents/trajectory.py): the first prompt, the
model's reply, the tokens the next prompt inserts (the tool's answer, the template's turns), the next
reply:

    messages   user "12+34+56="
               assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "12+34+56"}}</tool_call>
               tool       "102"
               assistant  "102"
    ids        P0 + S0 + N1 + S1      (P_i: render(messages up to reply i, generation prompt), S_i: reply i's
                                       text and the template's end-of-turn token; loss on S only)

A direct transcript answers at once. Training transcripts call the tool with probability `TOOL_FRACTION`:
half, where the embedded model's warm-start calls it in 0.3 (tasks/tool_transcripts.py). SmolLM2's direct
answers to three 2-digit sums are mostly wrong, so the policy starts out knowing both ways and RL can learn
that the tool pays; at 0.3 its validation transcripts were exact at most 0.47 of the time in 146 steps, at
0.5 all of them in 40 (`examples/agents/calculator_smollm2.yaml`). The stop rule's validation
transcripts all call it (`tool_fraction=1`): their replies copy the expression and the tool's answer, the
convention being taught, where a direct reply's exactness would measure the model's arithmetic.
The tools are rendered as `CALCULATOR_TOOL`, the signature the example agent offers. Each reply is
tokenized on its own, as a sampled reply's tokens come; a template under which the next prompt does
not extend them (so that the endpoint would start a new sample there) is refused.
"""

from __future__ import annotations

import json
import random

import torch

from distflow.config.errors import ConfigError
from distflow.envs.calculator import CALCULATOR_TOOL
from distflow.training.sequences import encode_prompts, left_pad

TOOLS = [CALCULATOR_TOOL]
TOOL_FRACTION = 0.5


def episode(row: dict, *, use_tool: bool) -> list[dict]:
    """The messages of one episode of the calculator agent on `row` ({"prompt": "a+b+c=", "answer"})."""
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    if use_tool:
        arguments = json.dumps({"expression": row["prompt"].rstrip("=")})  # as the endpoint serialises a call
        call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": row["answer"]})
    messages.append({"role": "assistant", "content": row["answer"]})
    return messages


def transcript(tokenizer, chat_template: str | None, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of an episode: the last reply's prompt, then that reply; loss on every reply."""
    stops = {tokenizer.eos_token_id, *_ids_of(tokenizer, ["<|im_end|>", "<|eot_id|>", "<end_of_turn>"])}
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for i in replies:
        prompt = _render(tokenizer, chat_template, messages[:i], generation=True)
        whole = _render(tokenizer, chat_template, messages[: i + 1], generation=False)
        if not whole.startswith(prompt):
            raise ConfigError(
                "warmstart.tool_transcripts: the chat template renders a reply other than after its prompt"
            )
        prompt_ids = encode_prompts(tokenizer, [prompt])[0]
        if prompt_ids[: len(ids)] != ids:
            raise ConfigError(
                "warmstart.tool_transcripts: under this chat template a turn's prompt does not extend the tokens "
                "of the turns before it, so an agent's episode would not be one sample: use model.chat_template="
                "chatml-tools"
            )
        reply = _reply_ids(tokenizer, whole[len(prompt) :], stops)
        spans.append((len(prompt_ids), len(prompt_ids) + len(reply)))
        ids = prompt_ids + reply
    loss = [0] * len(ids)
    for start, end in spans:
        loss[start:end] = [1] * (end - start)
    return ids, loss


def transcript_batch(tokenizer, chat_template, rows: list[dict], seed: int, *, tool_fraction: float = TOOL_FRACTION):
    """(ids_BT, mask_BT, loss_mask_BT) of a mixed batch, left-padded; row i calls the tool with probability
    `tool_fraction`, drawn from (seed, i)."""
    rng = random.Random(seed)
    pairs = [transcript(tokenizer, chat_template, episode(row, use_tool=rng.random() < tool_fraction)) for row in rows]
    ids_BT, mask_BT = left_pad([ids for ids, _ in pairs], tokenizer.pad_token_id)
    loss_BT, _ = left_pad([loss for _, loss in pairs], 0, width=ids_BT.shape[1])
    return ids_BT, mask_BT, loss_BT


def exact_replies(model, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[B] bool: whether every reply token of each transcript is the model's most likely next token."""
    from distflow.training.sequences import position_ids_from_mask

    ids_BT, mask_BT, loss_BT = batch
    with torch.no_grad():
        logits_BTV = model(
            input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids_from_mask(mask_BT)
        ).logits
    hit_BT = logits_BTV[:, :-1].argmax(-1) == ids_BT[:, 1:]
    return (hit_BT | (loss_BT[:, 1:] == 0)).all(dim=1)


def _render(tokenizer, chat_template, messages: list[dict], *, generation: bool) -> str:
    from distflow.agents.requests import RequestError, template_text

    try:
        return template_text(tokenizer, messages, TOOLS, chat_template, generation=generation)
    except RequestError as err:
        raise ConfigError(f"warmstart.tool_transcripts: {err}") from None


def _reply_ids(tokenizer, text: str, stops: set) -> list[int]:
    """A reply's tokens as the model samples them: its text, ending at the template's end-of-turn token
    (what follows it, a newline, is the next prompt's)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    end = next((k for k, token in enumerate(ids) if token in stops), None)
    if end is None:
        raise ConfigError(
            "warmstart.tool_transcripts: the chat template ends a reply with no stop token of the tokenizer"
        )
    return ids[: end + 1]


def _ids_of(tokenizer, tokens: list[str]) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in tokens if t in vocab]
