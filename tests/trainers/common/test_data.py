"""Tokenization, completion-only labels, packing, truncation and cursor resume."""

from __future__ import annotations

import numpy as np
import pytest

from trainers.common.data import (
    FALLBACK_CHAT_TEMPLATE,
    IGNORE_INDEX,
    DataCursor,
    TrainingData,
    block_causal_mask,
    pack_greedy,
    tokenize_dataset,
    tokenize_example,
)
from trainers.common.formats import Example, Message, read_examples


def _trained_text(tok, t) -> str:
    return tok.decode([i for i, lab in zip(t.input_ids, t.labels, strict=True) if lab != IGNORE_INDEX])


def test_labels_cover_exactly_the_weighted_assistant_turns(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = Example((
        Message("system", "sys"),
        Message("user", "u1"),
        Message("assistant", "skip me", 0),
        Message("user", "u2"),
        Message("assistant", "train é"),
    ))
    t = tokenize_example(tok, ex)
    # the exact positions: the last turn's content bytes + <|eot_id|>, nothing else
    rendered = tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in ex.messages], tokenize=False
    )
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert list(t.input_ids) == ids
    n_trained = len("train é".encode()) + 1
    expected = [IGNORE_INDEX] * (len(ids) - n_trained) + ids[-n_trained:]
    assert list(t.labels) == expected
    assert _trained_text(tok, t) == "train é<|eot_id|>"


def test_two_trained_turns_and_prompt_completion(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = Example((Message("user", "a"), Message("assistant", "b"), Message("user", "c"), Message("assistant", "d")))
    assert _trained_text(tok, tokenize_example(tok, ex)) == "b<|eot_id|>d<|eot_id|>"
    (pc,) = read_examples(['{"prompt": "", "completion": "only"}'])
    t = tokenize_example(tok, pc)
    assert _trained_text(tok, t) == "only<|eot_id|>" and t.labels[0] == IGNORE_INDEX


def test_fallback_template_without_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = None
    ex = Example((Message("user", "q"), Message("assistant", "ans")))
    t = tokenize_example(tok, ex)
    assert tok.decode(list(t.input_ids)) == "<|begin_of_text|>### user\nq\n### assistant\nans<|end_of_text|>\n"
    assert _trained_text(tok, t) == "ans<|end_of_text|>\n"
    assert "bos_token" in FALLBACK_CHAT_TEMPLATE


def test_truncation_is_counted_and_label_less_examples_dropped(tiny_tokenizer):
    long_answer = Example((Message("user", "q"), Message("assistant", "x" * 100)))
    long_prompt = Example((Message("user", "q" * 100), Message("assistant", "a")))
    ds = tokenize_dataset(tiny_tokenizer, [long_answer, long_prompt], max_seq_len=32)
    assert (ds.n_truncated, ds.n_dropped, len(ds.examples)) == (2, 1, 1)
    assert len(ds.examples[0]) == 32


def _dataset(tok, n=10):
    exs = [Example((Message("user", "u" * (i % 4 + 1)), Message("assistant", f"a{i}"))) for i in range(n)]
    return tokenize_dataset(tok, exs, max_seq_len=96)


def test_packing_keeps_examples_whole_and_resets_positions(tiny_tokenizer):
    ds = _dataset(tiny_tokenizer)
    data = TrainingData(ds, max_seq_len=96, micro_batch_size=2, seed=3, packing=True, pad_id=258)
    rows = data.rows(0)
    assert sorted(i for r in rows for i in r) == list(range(10))  # every example exactly once
    assert all(sum(len(ds.examples[i]) for i in r) <= 96 for r in rows)
    b = data.collate(rows[:1])
    seg, pos = b.segment_ids[0], b.position_ids[0]
    t = 0
    for k, i in enumerate(rows[0], start=1):
        ex = ds.examples[i]
        n = len(ex)
        assert (seg[t : t + n] == k).all()
        assert (pos[t : t + n] == np.arange(n)).all()
        assert (b.input_ids[0, t : t + n] == ex.input_ids).all()
        assert b.labels[0, t] == IGNORE_INDEX  # no loss across the boundary
        assert (b.labels[0, t + 1 : t + n] == ex.labels[1:]).all()
        t += n
    assert (seg[t:] == 0).all() and (b.labels[0, t:] == IGNORE_INDEX).all()
    mask = block_causal_mask(b.segment_ids)[0, 0]
    first, second = len(ds.examples[rows[0][0]]), len(ds.examples[rows[0][1]])
    assert mask[first, first] and not mask[first, first - 1]  # 2nd example can't see the 1st
    assert mask[first + second - 1, first] and not mask[first, first + 1]


def test_pack_greedy_order_and_limits():
    assert pack_greedy([5, 5, 5, 9, 1], [0, 1, 2, 3, 4], 10) == [[0, 1], [2], [3, 4]]


def test_shuffle_is_deterministic_per_seed_and_epoch(tiny_tokenizer):
    ds = _dataset(tiny_tokenizer)
    a = TrainingData(ds, max_seq_len=96, micro_batch_size=1, seed=1)
    b = TrainingData(ds, max_seq_len=96, micro_batch_size=1, seed=1)
    c = TrainingData(ds, max_seq_len=96, micro_batch_size=1, seed=2)
    assert a.rows(0) == b.rows(0) and a.rows(1) == b.rows(1)
    assert a.rows(0) != a.rows(1) and a.rows(0) != c.rows(0)
    unshuffled = TrainingData(ds, max_seq_len=96, micro_batch_size=1, seed=1, shuffle=False)
    assert unshuffled.rows(0) == [[i] for i in range(10)]


@pytest.mark.parametrize("packing", [False, True])
def test_cursor_resume_yields_identical_batches(tiny_tokenizer, packing):
    ds = _dataset(tiny_tokenizer)
    kw = {"max_seq_len": 96, "micro_batch_size": 3, "seed": 7, "packing": packing, "pad_id": 258}
    full = TrainingData(ds, **kw).micro_batches()
    reference = [next(full) for _ in range(12)]  # crosses several epochs
    assert len({b.cursor_after.epoch for b in reference}) > 2
    cut = 5
    resumed = TrainingData(ds, **kw).micro_batches(DataCursor.from_dict(reference[cut - 1].cursor_after.to_dict()))
    for want in reference[cut:]:
        got = next(resumed)
        for name in ("input_ids", "labels", "position_ids", "segment_ids", "attention_mask"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert got.cursor_after == want.cursor_after


def test_batches_never_span_epochs_and_pad_to(tiny_tokenizer):
    ds = _dataset(tiny_tokenizer)
    data = TrainingData(ds, max_seq_len=96, micro_batch_size=4, seed=0, pad_to=96, pad_id=258)
    it = data.micro_batches()
    sizes = [next(it).input_ids.shape for _ in range(3)]
    assert sizes == [(4, 96), (4, 96), (2, 96)]
    assert next(it).cursor_after == DataCursor(1, 4)
    with pytest.raises(ValueError):
        TrainingData(type(ds)(examples=[]), max_seq_len=8, micro_batch_size=1, seed=0)


# --- preference pairs (DPO) ---

def _pref_example(chosen="4", rejected="five"):
    from trainers.common.formats import PreferenceExample

    return PreferenceExample(
        prompt=(Message("system", "add"), Message("user", "2+2?")),
        chosen=Message("assistant", chosen),
        rejected=Message("assistant", rejected),
    )


def test_preference_pair_shares_the_prompt_and_labels_only_the_answers(tiny_tokenizer):
    from trainers.common.data import tokenize_preference

    tok = tiny_tokenizer
    chosen, rejected = tokenize_preference(tok, _pref_example(), max_seq_len=512)
    prompt_text = tok.apply_chat_template(
        [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2?"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert prompt_text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    for seq, answer in ((chosen, "4"), (rejected, "five")):
        assert list(seq.input_ids[:n]) == prompt_ids
        assert tok.decode(list(seq.input_ids)) == prompt_text + answer + "<|eot_id|>"
        assert list(seq.labels[:n]) == [IGNORE_INDEX] * n
        assert list(seq.labels[n:]) == list(seq.input_ids[n:])
        assert _trained_text(tok, seq) == answer + "<|eot_id|>"


@pytest.mark.parametrize(
    ("n_prompt", "n_answers", "max_len", "kept_prompt", "kept_answers"),
    [
        (10, (5, 3), 15, 10, (5, 3)),    # fits: unchanged
        (10, (5, 3), 12, 7, (5, 3)),     # prompt cut from the left, answers whole
        (10, (30, 3), 20, 10, (10, 3)),  # answer > half the window: prompt kept (<= half), answers cut
        (40, (30, 3), 20, 10, (10, 3)),  # both long: prompt keeps half, answers the rest
    ],
)
def test_truncate_preference_rule(n_prompt, n_answers, max_len, kept_prompt, kept_answers):
    from trainers.common.data import truncate_preference

    prompt = list(range(100, 100 + n_prompt))
    answers = [list(range(1000 * (k + 1), 1000 * (k + 1) + n)) for k, n in enumerate(n_answers)]
    p, (a, b) = truncate_preference(prompt, answers, max_len)
    assert p == prompt[n_prompt - kept_prompt :]  # the prompt's END survives
    assert (len(a), len(b)) == kept_answers
    assert a == answers[0][: len(a)] and b == answers[1][: len(b)]  # the answers' START survives
    assert len(p) + max(len(a), len(b)) <= max_len


def test_preference_dataset_counts_truncated_pairs(tiny_tokenizer):
    from trainers.common.data import tokenize_preference, tokenize_preference_dataset

    short, long = _pref_example(), _pref_example(chosen="x" * 200)
    ds = tokenize_preference_dataset(tiny_tokenizer, [short, long], max_seq_len=64)
    assert (ds.n_truncated, ds.n_dropped, len(ds.pairs)) == (1, 0, 2)
    assert ds.pairs[0] == tokenize_preference(tiny_tokenizer, short, max_seq_len=64)
    chosen, rejected = ds.pairs[1]
    assert len(chosen) == 64 and chosen.input_ids[-1] == ord("x")  # cut at the end
    assert chosen.input_ids[:32] == rejected.input_ids[:32]  # both keep the same 32 prompt tokens
    assert chosen.labels[31] == IGNORE_INDEX and chosen.labels[32] != IGNORE_INDEX
    assert ds.n_tokens == sum(len(c) + len(r) for c, r in ds.pairs)


# --- tool calls: rendered by the model's template, trained on; tool results never ---

TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},)


def _tool_example(call_weight=1):
    from trainers.common.formats import ToolCall

    return Example(
        messages=(
            Message("system", "You help."),
            Message("user", "Weather in Paris?"),
            Message("assistant", "", weight=call_weight,
                    tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris", "unit": "C"}'),)),
            Message("tool", "21 C", tool_call_id="c1"),
            Message("assistant", "It is 21 C."),
        ),
        tools=TOOLS,
    )


def test_chat_template_messages_parse_arguments_for_the_template():
    from trainers.common.data import chat_template_messages

    msgs = chat_template_messages(_tool_example().messages)
    assert msgs[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]}
    assert msgs[3] == {"role": "tool", "content": "21 C", "tool_call_id": "c1"}
    assert msgs[1] == {"role": "user", "content": "Weather in Paris?"}


def test_loss_covers_tool_calls_and_answers_never_tool_results(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = _tool_example()
    t = tokenize_example(tok, ex)
    from trainers.common.data import chat_template_messages

    rendered = tok.apply_chat_template(chat_template_messages(ex.messages), tools=list(TOOLS), tokenize=False)
    assert list(t.input_ids) == tok(rendered, add_special_tokens=False)["input_ids"]
    assert "get_weather" in rendered.split("<|eot_id|>")[0]  # the tools are in the system header
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}<|eot_id|>'
    assert _trained_text(tok, t) == call + "It is 21 C.<|eot_id|>"
    # the trained tokens are exactly those two spans of the rendered text, in place
    labelled = [i for i, lab in enumerate(t.labels) if lab != IGNORE_INDEX]
    first = rendered.index(call)
    n_call = len(tok(call, add_special_tokens=False)["input_ids"])
    n_head = len(tok(rendered[:first], add_special_tokens=False)["input_ids"])
    assert labelled[:n_call] == list(range(n_head, n_head + n_call))
    # a weight-0 tool-call turn is not trained on
    assert _trained_text(tok, tokenize_example(tok, _tool_example(call_weight=0))) == "It is 21 C.<|eot_id|>"


def test_fallback_template_renders_tools_and_calls(tiny_tokenizer):
    from trainers.common.data import chat_template_messages

    t = tokenize_example(tiny_tokenizer, _tool_example(), template=FALLBACK_CHAT_TEMPLATE)
    text = tiny_tokenizer.decode(list(t.input_ids))
    assert text == tiny_tokenizer.apply_chat_template(
        chat_template_messages(_tool_example().messages), tools=list(TOOLS),
        chat_template=FALLBACK_CHAT_TEMPLATE, tokenize=False)
    assert text.startswith('<|begin_of_text|>### tools\n{"type": "function", "function": {"name": "get_weather"')
    assert _trained_text(tiny_tokenizer, t) == (
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}<|end_of_text|>\n'
        "It is 21 C.<|end_of_text|>\n"
    )


def test_preference_prompt_with_tools_and_a_tool_call_answer(tiny_tokenizer):
    from trainers.common.data import tokenize_preference
    from trainers.common.formats import PreferenceExample, ToolCall

    ex = PreferenceExample(
        prompt=(Message("user", "Weather in Paris?"),),
        chosen=Message("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),)),
        rejected=Message("assistant", "No idea."),
        tools=TOOLS,
    )
    chosen, rejected = tokenize_preference(tiny_tokenizer, ex, max_seq_len=1024)
    assert _trained_text(tiny_tokenizer, chosen) == '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
    assert _trained_text(tiny_tokenizer, rejected) == "No idea.<|eot_id|>"
    prompt = tiny_tokenizer.decode(
        [i for i, lab in zip(chosen.input_ids, chosen.labels, strict=True) if lab == IGNORE_INDEX])
    assert "Environment: ipython" in prompt and prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_labels_equal_transformers_assistant_tokens_mask(tiny_tokenizer):
    """The reference: transformers' ``return_assistant_tokens_mask`` (the template's
    {% generation %} blocks, as TRL's assistant-only loss uses) marks the same tokens."""
    from trainers.common.data import chat_template_messages

    for ex in (_tool_example(), Example((Message("user", "a"), Message("assistant", "b é"),
                                         Message("user", "c"), Message("assistant", "d")))):
        ours = tokenize_example(tiny_tokenizer, ex)
        ref = tiny_tokenizer.apply_chat_template(
            chat_template_messages(ex.messages), tools=list(ex.tools) or None, tokenize=True,
            return_dict=True, return_assistant_tokens_mask=True)
        assert list(ours.input_ids) == list(ref["input_ids"])
        assert [int(lab != IGNORE_INDEX) for lab in ours.labels] == list(ref["assistant_masks"])


# A template that, like some real ones, takes at most one tool call per message.
ONE_CALL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message.get('tool_calls') or []) | length > 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def test_a_template_refusing_an_example_is_a_user_error_naming_it(tiny_model_dir, tmp_path):
    import json

    from transformers import AutoTokenizer

    from trainers.common.data import ChatTemplateError
    from trainers.common.job_data import tokenize_file
    from trainers.errors import UserError

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = ONE_CALL_TEMPLATE
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    two_calls = {"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "tool_calls": [{**call, "id": "1"}, {**call, "id": "2"}]}]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(two_calls) + "\n")
    with pytest.raises(ChatTemplateError, match="example 2: .*single tool-calls"):
        tokenize_dataset(tok, read_examples(path), 64)
    with pytest.raises(UserError) as err:
        tokenize_file(path, "chat", tok, 64)
    assert err.value.code == "invalid_dataset" and "train.jsonl: example 2" in str(err.value)


def test_preference_tokenization_equals_trl_dpo_tokenization(tiny_tokenizer, tmp_path):
    """The reference: TRL's DPOTrainer dataset preparation (conversational rows with
    tools) gives the same prompt, chosen and rejected ids."""
    import types

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from trainers.common.data import chat_template_messages, tokenize_preference
    from trainers.common.formats import PreferenceExample, ToolCall

    call = ToolCall("c1", "get_weather", '{"city": "Oslo"}')
    examples = [
        _pref_example(),
        PreferenceExample(prompt=(Message("user", "Weather in Oslo?"),),
                          chosen=Message("assistant", "", tool_calls=(call,)),
                          rejected=Message("assistant", "Sunny, I guess."), tools=TOOLS),
        PreferenceExample(
            prompt=(Message("user", "Weather in Oslo?"), Message("assistant", "", tool_calls=(call,)),
                    Message("tool", "-3 C", tool_call_id="c1")),
            chosen=Message("assistant", "It is -3 C in Oslo."), rejected=Message("assistant", "It is 30 C."),
            tools=TOOLS),
    ]
    rows = [{"prompt": chat_template_messages(ex.prompt), "chosen": chat_template_messages([ex.chosen]),
             "rejected": chat_template_messages([ex.rejected]), "tools": list(ex.tools) or None} for ex in examples]
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, dataset_num_proc=None)
    reference = DPOTrainer._prepare_dataset(
        types.SimpleNamespace(_tokenizer=tiny_tokenizer), Dataset.from_list(rows), tiny_tokenizer, args, "train")
    for ex, ref in zip(examples, reference, strict=True):
        chosen, rejected = tokenize_preference(tiny_tokenizer, ex, max_seq_len=4096)
        n = len(ref["prompt_ids"])
        assert list(chosen.input_ids) == ref["prompt_ids"] + ref["chosen_ids"]
        assert list(rejected.input_ids) == ref["prompt_ids"] + ref["rejected_ids"]
        assert chosen.labels[:n] == rejected.labels[:n] == (IGNORE_INDEX,) * n
        assert list(chosen.labels[n:]) == ref["chosen_ids"] and list(rejected.labels[n:]) == ref["rejected_ids"]


def test_a_template_without_tool_support_is_refused_not_trained_on_silently(tiny_model_dir):
    from transformers import AutoTokenizer

    from trainers.common.data import ChatTemplateError, tokenize_preference_dataset
    from trainers.common.formats import PreferenceExample

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = ONE_CALL_TEMPLATE  # renders neither tools nor tool calls
    with pytest.raises(ChatTemplateError, match="example 1: .*ignores the line's 'tools'"):
        tokenize_dataset(tok, [_tool_example()], 512)
    no_tools = Example(_tool_example().messages)
    with pytest.raises(ChatTemplateError, match="example 1: .*tool call.* get_weather of assistant turn 2"):
        tokenize_dataset(tok, [no_tools], 512)
    pref = PreferenceExample(prompt=(Message("user", "q"),), chosen=Message("assistant", "a"),
                             rejected=no_tools.messages[2])
    with pytest.raises(ChatTemplateError, match="get_weather of the rejected answer"):
        tokenize_preference_dataset(tok, [pref], 512)
