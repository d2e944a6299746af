"""scripts/make_chat_data.py: requests it cannot fill end in one line (exit 2), and ``pairs``
rejects another answer, never the chosen one, in time linear in the file."""
import json
import random
import re

import pytest

from scripts import make_chat_data


def _write(path, answers):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i}?"},
        {"role": "assistant", "content": a}]}) + "\n" for i, a in enumerate(answers)))
    return path


def test_long_with_too_few_tokens_ends_in_one_line_naming_the_smallest_that_works(tmp_path, capsys):
    out = tmp_path / "long.jsonl"
    assert make_chat_data.main(["long", "--out", str(out), "--tokens", "300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and not out.exists()
    least = int(re.search(r"--tokens (\d+) is the smallest that can", err).group(1))
    assert least > 300
    made = make_chat_data.long_task(2, 0, "", least)
    assert len(made) == 2 and all(r["messages"][1]["content"] for r in made)


def test_long_stops_when_no_draw_finds_a_name_to_ask_about(tmp_path, monkeypatch):
    """Two files, each askable alone, always picked together: their one name is defined twice."""
    doc = "Return the thing that this function computes, described at some length here."
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text(
            f"def same():\n    \"\"\"{doc}\"\"\"\n    return 1\n" + "# padding\n" * 40)
    monkeypatch.setattr(make_chat_data, "modules",
                        lambda: [(n, str(tmp_path / f"{n}.py")) for n in ("a", "b")])
    with pytest.raises(make_chat_data.Unfillable, match="made 0 of 3 conversations: 1,000 draws"):
        make_chat_data.long_task(3, 0, "", 3800)


def test_pairs_of_one_answer_is_a_clear_error(tmp_path, capsys):
    source = _write(tmp_path / "same.jsonl", ["the one answer"] * 5)
    out = tmp_path / "pairs.jsonl"
    assert make_chat_data.main(["pairs", "--from", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: pairs: --from {source} has 5 conversation(s) and 1 distinct answer(s):"
                   " a pair rejects another answer, so it needs at least 2 different answers\n")
    assert not out.exists()


def test_pairs_never_rejects_the_chosen_answer_and_draws_evenly_from_the_others(tmp_path):
    """Mostly one answer: the draw is the old list's (every conversation with another answer,
    ascending, rng.choice), so a seed gives the file it gave before the draw was made linear."""
    answers = ["a"] * 40 + ["b", "c", "b", "d"] + ["a"] * 10 + ["e"] * 6
    random.Random(1).shuffle(answers)
    source = _write(tmp_path / "convs.jsonl", answers)
    for seed in range(3):
        got = make_chat_data.pairs(str(source), len(answers), seed)
        rng = random.Random(seed)
        want = [answers[rng.choice([k for k in range(len(answers)) if answers[k] != a])]
                for a in answers]
        assert [p["chosen"][0]["content"] for p in got] == answers
        assert [p["rejected"][0]["content"] for p in got] == want
        assert all(p["rejected"] != p["chosen"] for p in got)
