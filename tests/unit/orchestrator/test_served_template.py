"""The server's chat template (orchestrator/served_template.py, the launcher's --chat-template): vLLM's rule for a
file or the template itself, the checks that name the parameter, and the prompt it writes (no server)."""
import argparse

import pytest

from backends.runtime.tokenizer import load_tokenizer
from backends.triton import launch_options
from backends.triton.repository import REPOSITORY, edited_config
from orchestrator.served_template import load_chat_template, with_template

SHORT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m.content %}{{ p.text }}{% endfor %}<|im_end|>\n" \
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def test_a_file_is_read_and_a_template_is_taken_as_it_is_with_its_escapes_decoded(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(SHORT + "é", encoding="utf-8")
    assert load_chat_template(str(path)) == SHORT + "é"
    assert load_chat_template("{{ 'é' }}\\n{{ 1 }}") == "{{ 'é' }}\n{{ 1 }}"  # vLLM decodes a flag's escapes
    assert load_chat_template("") is None and load_chat_template("  ") is None  # the checkpoint's


@pytest.mark.parametrize("value, says", [
    ("templates/missing.jinja", "'templates/missing.jinja' looks like a file path, but it cannot be opened "
                                "(No such file or directory)"),
    ("{% for m in messages %}", "not a valid Jinja template (line 1: "),
])
def test_a_missing_file_or_a_broken_template_is_refused_naming_the_parameter(value, says):
    with pytest.raises(ValueError) as exc:
        load_chat_template(value)
    assert str(exc.value).startswith("parameter chat_template: " + says), exc.value


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_bytes(b"\xff{{ 1 }}")
    with pytest.raises(ValueError, match=f"parameter chat_template: {path} is not UTF-8 text"):
        load_chat_template(str(path))


def test_the_template_writes_the_prompt_and_one_of_string_contents_is_refused():
    tokenizer = with_template(load_tokenizer(None), SHORT)
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Hi."}]}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
    assert with_template(tokenizer, None) is tokenizer  # None: the template it has
    with pytest.raises(ValueError, match="writes a message's content as a string; this server needs one that reads"):
        with_template(load_tokenizer(None), "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="cannot write a message whose content is a list of parts"):
        with_template(load_tokenizer(None), "{% for m in messages %}{{ m.content + 'x' }}{% endfor %}")


def test_the_launcher_option_passes_a_files_absolute_path_or_the_template_through_the_config(tmp_path, monkeypatch):
    (tmp_path / "t.jinja").write_text(SHORT)
    monkeypatch.chdir(tmp_path)
    plan = launch_options.serve_plan(argparse.Namespace(config=None, model=None, chat_template="t.jinja",
                                                        overrides=[], gpu_sharing=None), REPOSITORY)
    assert plan.overrides["orchestrator"]["chat_template"] == str(tmp_path / "t.jinja")
    assert launch_options.template_option(SHORT) == SHORT
    with pytest.raises(ValueError, match="^--chat-template: 'nope.jinja' looks like a file path"):
        launch_options.template_option("nope.jinja")
    # the template itself goes into config.pbtxt on one line, its line breaks escaped as the text format has them
    config = 'parameters { key: "chat_template" value { string_value: "" } }\n'
    assert edited_config(config, {"chat_template": 'a\n"b"\\'}) == \
        'parameters { key: "chat_template" value { string_value: "a\\n\\"b\\"\\\\" } }\n'
