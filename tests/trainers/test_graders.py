"""The graders library (``trainers.common.graders``): OpenAI's grader objects, templates,
metrics against their libraries' published examples, formulas, and grading outcomes.

Python graders run in the sandbox here too (one small process per call); the attacks on
the sandbox are in ``test_grader_sandbox.py``.
"""

from __future__ import annotations

import pytest

from trainers.common.graders import (
    ChatCompletionError,
    ChatReply,
    ChatRequest,
    GraderInvalid,
    GradingContext,
    SandboxLimits,
    formula,
    grade,
    grade_batch,
    metrics,
    parse_grader,
    sample_namespace,
    templates,
)

CONTEXT = GradingContext(sandbox=SandboxLimits(seconds_per_sample=20, startup_seconds=20))


def string_check(operation: str, input: str = "{{sample.output_text}}", reference: str = "{{item.label}}") -> dict:
    return {"type": "string_check", "name": "check", "input": input, "reference": reference, "operation": operation}


@pytest.mark.parametrize(("operation", "output", "label", "reward"), [
    ("eq", "Paris", "Paris", 1.0), ("eq", "paris", "Paris", 0.0),
    ("ne", "Lyon", "Paris", 1.0), ("ne", "Paris", "Paris", 0.0),
    ("like", "It is Paris.", "Paris", 1.0), ("like", "It is paris.", "Paris", 0.0),
    ("ilike", "It is PARIS.", "paris", 1.0), ("ilike", "It is Lyon.", "paris", 0.0),
])
def test_string_check_operations(operation: str, output: str, label: str, reward: float) -> None:
    grader = parse_grader(string_check(operation))
    assert grade(grader, sample_namespace(output), {"label": label}, CONTEXT).reward == reward


def test_templates_read_json_paths_of_the_item_and_the_sample() -> None:
    sample = sample_namespace('{"answer": {"cities": ["Lima", "Quito"]}, "n": 2}')
    item = {"meta": {"key with space": "x"}, "list": [1, {"b": True}]}
    rendered = templates.render("{{ sample.output_json.answer.cities[1] }}/{{sample.output_json.n}}/"
                                "{{item.meta['key with space']}}/{{item.list}}/{{ item.list[1].b }}", item, sample)
    assert rendered == 'Quito/2/x/[1, {"b": true}]/true'
    assert templates.render("{{sample.choices[0].message.content}}", {}, sample_namespace("hi")) == "hi"
    with pytest.raises(templates.MissingVariable):
        templates.render("{{item.absent}}", item, sample)
    with pytest.raises(templates.SampleNotJSON):
        templates.render("{{sample.output_json.answer}}", item, sample_namespace("not json"))


@pytest.mark.parametrize("text", ["{{foo.bar}}", "{{sample.output}}", "{{item}}", "{{item.a b}}", "{{ item.x",
                                  "{{}}"])
def test_templates_that_can_never_resolve_are_refused(text: str) -> None:
    with pytest.raises(templates.TemplateError):
        templates.check(text)


def test_a_template_the_row_cannot_fill_is_reported_not_raised() -> None:
    grader = parse_grader(string_check("eq", reference="{{item.missing}}"))
    result = grade(grader, sample_namespace("x"), {"label": "x"}, CONTEXT)
    assert (result.reward, result.errors.invalid_variable_error) == (0.0, True)
    result = grade(parse_grader(string_check("eq", input="{{sample.output_json.a}}")), sample_namespace("plain"),
                   {"label": "x"}, CONTEXT)
    assert (result.reward, result.errors.sample_parse_error) == (0.0, True)


def test_metrics_reproduce_their_libraries_published_examples() -> None:
    # RapidFuzz's README: WRatio with default_process -> 95.0.
    assert metrics.fuzzy_match("this is a test", "this is a new test!!!") == pytest.approx(0.95)
    # NLTK's sentence_gleu docstring: 0.4393... and 0.1206...
    reference = "It is a guide to action that ensures that the military will forever heed Party commands"
    assert metrics.gleu("It is a guide to action which ensures that the military always obeys the commands of "
                        "the party", reference) == pytest.approx(0.4393, abs=1e-4)
    assert metrics.gleu("It is to insure the troops forever hearing the activity guidebook that party direct",
                        reference) == pytest.approx(0.1206, abs=1e-4)
    # rouge-score's README pair: rouge1 F 0.70588, rougeL F 0.58824.
    target, prediction = "The quick brown fox jumps over the lazy dog", "The quick brown dog jumps on the log."
    assert metrics.similarity("rouge_1", prediction, target) == pytest.approx(12 / 17)
    assert metrics.similarity("rouge_l", prediction, target) == pytest.approx(10 / 17)
    # BLEU: sacrebleu's smoothed sentence BLEU is 1 for the reference, 0 without a shared
    # word, and ranks a closer candidate higher.
    assert metrics.bleu("The dog bit the man.", "The dog bit the man.") == pytest.approx(1.0)
    assert metrics.bleu("Cats purr loudly", "The dog bit the man.") == 0.0
    assert 0 < metrics.bleu("The dog bit a man.", "The dog bit the man.") < 1
    assert metrics.bleu("The dog bit a man.", "The dog bit the man.") > metrics.bleu("A dog bit someone.",
                                                                                     "The dog bit the man.")
    assert [metrics.similarity(f"rouge_{n}", "a b c d e f", "a b c d e f") for n in range(1, 6)] == [1.0] * 5


@pytest.mark.skipif(not metrics.wordnet_available(), reason="NLTK's wordnet corpus is not installed here")
def test_meteor_reproduces_nltks_published_example() -> None:
    hypothesis = "It is a guide to action which ensures that the military always obeys the commands of the party"
    reference = "It is a guide to action that ensures that the military will forever heed Party commands"
    assert round(metrics.meteor(hypothesis, reference), 4) == 0.6944


def test_meteor_and_cosine_are_refused_where_they_cannot_be_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "wordnet_available", lambda: False)
    for metric in ("meteor", "cosine"):
        with pytest.raises(GraderInvalid) as refused:
            parse_grader({"type": "text_similarity", "name": "s", "input": "a", "reference": "b",
                          "evaluation_metric": metric})
        assert (refused.value.code, refused.value.param) == ("unsupported_evaluation_metric",
                                                             "grader.evaluation_metric")


@pytest.mark.parametrize(("text", "value"), [
    ("(name + email) / 2", 0.75), ("2 * name ^ 2", 0.5), ("name ** 2", 0.25), ("-name + +email", 0.5),
    ("min(name, email, 0.2)", 0.2), ("max(name, email)", 1.0), ("abs(name - email)", 0.5),
    ("floor(email * 1.5) + ceil(name)", 2.0), ("sqrt(4 * email)", 2.0), ("log(exp(name))", 0.5), ("log(8, 2)", 3.0),
])
def test_formulas_evaluate_openais_operators_and_functions(text: str, value: float) -> None:
    assert formula.evaluate(text, {"name": 0.5, "email": 1.0}) == pytest.approx(value)


@pytest.mark.parametrize("text", ["__import__('os').system('id')", "name.real", "(lambda: 1)()", "name > 0.5",
                                  "[name]", "max(name, key=abs)", "unknown + 1", "min", "sqrt(1, 2)", "'a'",
                                  "name if email else 0", "(" * 300 + "1" + ")" * 300, "x" * 3000])
def test_formulas_refuse_anything_else(text: str) -> None:
    with pytest.raises(formula.FormulaError):
        formula.check(text, {"name", "email"})


def test_formulas_without_a_value_fail_fast() -> None:
    for text in ("name / 0", "log(0 * name)", "sqrt(-1)", "9 ^ 9 ^ 9 ^ 9"):
        with pytest.raises(formula.FormulaRuntimeError):
            formula.evaluate(text, {"name": 1.0})


def test_the_guides_multi_grader_averages_its_sub_graders() -> None:
    grader = parse_grader({"type": "multi", "name": "contact", "calculate_output": "(name + email) / 2", "graders": {
        "name": {"name": "name_grader", "type": "text_similarity", "input": "{{sample.output_json.name}}",
                 "reference": "{{item.name}}", "evaluation_metric": "fuzzy_match", "pass_threshold": 0.9},
        "email": {"name": "email_grader", "type": "string_check", "input": "{{sample.output_json.email}}",
                  "reference": "{{item.email}}", "operation": "eq"}}})
    result = grade(grader, sample_namespace('{"name": "John Doe", "email": "john.doe@gmail.com"}'),
                   {"name": "John Doe", "email": "john.doe@gmail.com"}, CONTEXT)
    assert (result.reward, result.sub_rewards, result.errors.any()) == (1.0, {"name": 1.0, "email": 1.0}, False)
    wrong = grade(grader, sample_namespace('{"name": "John Doe", "email": "jd@x.org"}'),
                  {"name": "John Doe", "email": "john.doe@gmail.com"}, CONTEXT)
    assert wrong.reward == 0.5 and wrong.response()["sub_rewards"] == {"name": 1.0, "email": 0.0}


def test_python_graders_get_openais_sample_and_item_and_grade_a_batch() -> None:
    grader = parse_grader({"type": "python", "name": "py", "source": (
        "def grade(sample, item):\n"
        "    keys = sorted(sample)\n"
        "    assert keys == ['choices', 'output_audio', 'output_json', 'output_text', 'output_tools'], keys\n"
        "    return float(sample['output_json']['x'] == item['x'])\n")})
    samples = [sample_namespace('{"x": 1}'), sample_namespace('{"x": 2}'), sample_namespace("not json")]
    results = grade_batch(grader, samples, [{"x": 1}, {"x": 1}, {"x": 1}], CONTEXT)
    assert [r.reward for r in results[:2]] == [1.0, 0.0]
    assert results[2].errors.python_grader_runtime_error
    assert "TypeError" in results[2].errors.python_grader_runtime_error_details


class Chat:
    """A model grader's model: answers ``content`` (or raises), and records what it was asked."""

    def __init__(self, content: str | None = None, *, refusal: str | None = None, fail: bool = False) -> None:
        self.content, self.refusal, self.fail = content, refusal, fail
        self.asked: list[ChatRequest] = []

    def __call__(self, request: ChatRequest) -> ChatReply:
        self.asked.append(request)
        if self.fail:
            raise ChatCompletionError("unreachable")
        return ChatReply(content=self.content, refusal=self.refusal, model="judge-v1",
                         usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})


SCORE_MODEL = {"type": "score_model", "name": "judge", "model": "judge", "range": [0, 5],
               "sampling_params": {"temperature": 0, "seed": 3, "max_completions_tokens": 50},
               "input": [{"role": "system", "content": "Grade 0-5."},
                         {"role": "user", "content": [
                             {"type": "input_text", "text": "Ref: {{item.ref}} "},
                             {"type": "input_text", "text": "Answer: {{sample.output_text}}"}]}]}


@pytest.mark.parametrize(("chat", "reward", "flag"), [
    (Chat('{"steps": [{"description": "d", "conclusion": "c"}], "result": 4}'), 4.0, None),
    (Chat("7"), 5.0, None), (Chat("-2.5"), 0.0, None),
    (Chat("four"), 0.0, "model_grader_parse_error"), (Chat(None, refusal="no"), 0.0, "model_grader_refusal_error"),
    (Chat(fail=True), 0.0, "model_grader_server_error"),
])
def test_score_model_asks_the_injected_model_and_clips_to_its_range(chat: Chat, reward: float,
                                                                    flag: str | None) -> None:
    result = grade(parse_grader(SCORE_MODEL), sample_namespace("Lima"), {"ref": "Lima"}, GradingContext(chat=chat))
    assert result.reward == reward
    assert [name for name, value in result.errors.as_dict().items() if value is True] == ([flag] if flag else [])
    asked = chat.asked[0]
    assert asked.messages == [{"role": "system", "content": "Grade 0-5."},
                              {"role": "user", "content": "Ref: Lima Answer: Lima"}]
    assert (asked.model, asked.temperature, asked.seed, asked.max_completion_tokens) == ("judge", 0, 3, 50)
    if not chat.fail:
        assert result.sampled_model_name == "judge-v1" and result.token_usage == 10
        assert result.model_token_usage == {"judge-v1": {"prompt_tokens": 7, "completion_tokens": 3,
                                                         "total_tokens": 10}}


@pytest.mark.parametrize(("grader", "code", "param"), [
    ({"type": "nope"}, "invalid_grader", "grader.type"),
    (string_check("gt"), "invalid_grader", "grader.operation"),
    ({**string_check("eq"), "extra": 1}, "invalid_grader", "grader.extra"),
    ({"type": "string_check", "name": "n", "input": "x"}, "invalid_grader", "grader.reference"),
    (string_check("eq", input="{{items.label}}"), "invalid_grader_template", "grader.input"),
    ({"type": "python", "name": "p", "source": "def grade(sample):\n    return 1.0\n"}, "invalid_python_grader",
     "grader.source"),
    ({"type": "python", "name": "p", "source": "def grade(s, i)\n"}, "invalid_python_grader", "grader.source"),
    ({"type": "python", "name": "p", "source": "grade = 1\n"}, "invalid_python_grader", "grader.source"),
    ({"type": "python", "name": "p", "source": "#" * (256 * 1024 + 1)}, "invalid_grader", "grader.source"),
    ({**SCORE_MODEL, "range": [1, 0]}, "invalid_grader", "grader.range"),
    ({**SCORE_MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]},
     "invalid_grader", "grader.input[0].content"),
    ({"type": "multi", "calculate_output": "a", "graders": {"a": {"type": "multi", "calculate_output": "1",
                                                                  "graders": {}}}}, "invalid_grader",
     "grader.graders.a"),
    ({"type": "multi", "calculate_output": "a + b", "graders": {"a": string_check("eq")}}, "invalid_grader_formula",
     "grader.calculate_output"),
    ({"type": "multi", "calculate_output": "1", "graders": {"a": string_check("eq", reference="{{x.y}}")}},
     "invalid_grader_template", "grader.graders.a.reference"),
])
def test_malformed_graders_are_refused_with_a_stable_code_and_the_field(grader: dict, code: str, param: str) -> None:
    with pytest.raises(GraderInvalid) as refused:
        parse_grader(grader)
    assert (refused.value.code, refused.value.param) == (code, param), refused.value.message
