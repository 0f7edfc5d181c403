"""Pure-logic tier (one test builds the project tokenizer, which imports transformers): the built-in arithmetic task
generates deterministic, correct problems in disjoint train / held-out splits, and its verifier reads the last
integer of a response. Answers are checked against Python's own arithmetic, an independent reference."""

from __future__ import annotations

import re

import pytest

from miles_orchestrator.data.task import BuiltinTask, Problem, evaluate_expression, extract_answer, verify

EXPRESSION = re.compile(r"What is ((?:\d+ [-+*] )+\d+)\?")


def reference_answer(problem: Problem) -> int:
    match = EXPRESSION.fullmatch(problem.question)
    assert match, problem.question
    return int(eval(match.group(1)))  # only digits, spaces and + - * reach here (checked by the regex)


@pytest.mark.parametrize(
    "task",
    [
        BuiltinTask(),
        BuiltinTask(num_digits=1, operations=("+", "-", "*"), num_operands=4),
        BuiltinTask(num_digits=3, operations=("-", "*"), num_operands=3),
        BuiltinTask(num_digits=(2, 1)),
    ],
)
def test_answers_match_python_arithmetic(task: BuiltinTask) -> None:
    for split in ("train", "heldout"):
        for problem in task.problems(200, seed=7, split=split):
            assert problem.answer == reference_answer(problem)
            assert problem.label == str(problem.answer)
            operands = [int(x) for x in re.findall(r"\d+", problem.question)]
            assert len(operands) == task.num_operands
            assert [len(str(x)) for x in operands] == list(task.operand_digits)


def test_default_format() -> None:
    problem = BuiltinTask().problem(0)
    assert re.fullmatch(r"What is \d\d \+ \d\d\?", problem.question)
    assert BuiltinTask().sft_rows(1) == [{"prompt": problem.question, "response": str(problem.answer)}]


def test_deterministic_from_seed_and_index() -> None:
    task = BuiltinTask()
    assert task.problems(50, seed=1) == BuiltinTask().problems(50, seed=1)
    assert task.problem(17, seed=1) == task.problems(20, seed=1)[17]  # random access = sequential
    assert task.problems(50, seed=1) != task.problems(50, seed=2)
    assert task.problems(10, seed=1, start=5) == task.problems(15, seed=1)[5:]


def test_splits_are_disjoint_and_sized() -> None:
    task = BuiltinTask(heldout_fraction=0.1)
    train = {p.question for p in task.problems(3000, seed=0)}
    held_out = {p.question for p in task.problems(300, seed=0, split="heldout")}
    assert not train & held_out
    assert all(task.split_of(q) == "train" for q in train) and all(task.split_of(q) == "heldout" for q in held_out)
    every = {f"What is {a} + {b}?" for a in range(10, 100) for b in range(10, 100)}
    share = sum(task.split_of(q) == "heldout" for q in every) / len(every)
    assert 0.08 < share < 0.12
    assert len(held_out) > 250  # enough distinct held-out problems to measure a pass rate


def test_sft_rows_come_from_train_split() -> None:
    task = BuiltinTask()
    rows = task.sft_rows(500, seed=3)
    assert rows == task.sft_rows(500, seed=3) and len(rows) == 500
    assert all(task.split_of(r["prompt"]) == "train" for r in rows)
    for row, problem in zip(rows, task.problems(500, seed=3), strict=True):
        assert verify(row["response"], problem.label) == 1.0


def test_precedence() -> None:
    assert evaluate_expression([2, 3, 4], ["+", "*"]) == 14
    assert evaluate_expression([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate_expression([9, 3, 4], ["-", "-"]) == 2


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("85", "85", 1.0),
        ("85", 85, 1.0),
        ("37 + 48 = 85", "85", 1.0),
        ("The answer is 85.", "85", 1.0),
        ("84", "85", 0.0),
        ("85 or 84", "85", 0.0),  # the last integer counts
        ("8 5", "85", 0.0),
        ("", "85", 0.0),
        ("no number", "85", 0.0),
        ("-11", "-11", 1.0),
        ("1,234", "1234", 1.0),
        ("85, 86", "86", 1.0),
    ],
)
def test_verify(response: str, label: str | int, expected: float) -> None:
    assert verify(response, label) == expected


def test_verify_rejects_bad_labels() -> None:
    with pytest.raises(ValueError, match="integer"):
        verify("1", "one")
    with pytest.raises(ValueError, match="integer"):
        verify("1", [1])
    assert extract_answer("x = -3, y = 4") == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_digits": 0}, "num_digits"),
        ({"num_digits": (2,)}, "one count per operand"),
        ({"num_digits": (2, 10)}, "num_digits"),
        ({"operations": ("/",)}, "operations"),
        ({"operations": ()}, "operations"),
        ({"num_operands": 1}, "num_operands"),
        ({"heldout_fraction": 1.0}, "heldout_fraction"),
    ],
)
def test_bad_knobs_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BuiltinTask(**kwargs)  # type: ignore[arg-type]


def test_digits_tokenize_one_at_a_time() -> None:
    testing = pytest.importorskip("miles_kernels.testing")
    tokenizer = testing.build_tokenizer()
    problem = BuiltinTask(num_digits=3).problem(0)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(problem.label))
    assert pieces == list(problem.label)
    question_pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(problem.question))
    assert sum(p.isdigit() for p in question_pieces) == 6  # each digit of each operand is its own token
