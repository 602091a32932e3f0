"""The server's chat template (orchestrator/served_template.py, the launcher's --chat-template): vLLM's rule for a
file or the template itself, the checks that name the parameter, and the prompt it writes (no server)."""
import argparse

import pytest

from backends.runtime.families.registry import offline_tokenizer
from backends.runtime.tokenizer import load_tokenizer
from backends.triton import launch_options
from backends.triton.repository import REPOSITORY, edited_config
from flashcodec.families import family
from orchestrator.chat_options import ChatOptions
from orchestrator.messages import Part, Turn
from orchestrator.prompt import build_chat_prompt
from orchestrator.sampling_params import InvalidInput
from orchestrator.served_template import load_chat_template, with_template

QWEN = family("qwen2_5_vl")

SHORT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m.content %}"
         "{% if p.type == 'text' %}{{ p.text }}{% else %}<|vision_start|><|{{ p.type }}_pad|><|vision_end|>{% endif %}"
         "{% endfor %}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen2.5-VL's, shortened


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


QWEN_OWN = load_tokenizer(None).chat_template


def _prompt(template: str, turns, media=(), options=ChatOptions()) -> str:
    tokenizer = with_template(load_tokenizer(None), template, QWEN)
    return tokenizer.decode(build_chat_prompt(tokenizer, turns, list(media), QWEN, options).input_ids)


def test_the_template_writes_every_prompt_and_may_leave_a_text_out():
    hi = Turn("user", (Part("text", "Hi."),))
    assert _prompt(SHORT, (hi,)) == "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
    tokenizer = load_tokenizer(None)
    assert with_template(tokenizer, None, QWEN) is tokenizer  # None: the template it has
    no_system = QWEN_OWN.replace("{% for message in messages %}",
                                 "{% for message in messages if message['role'] != 'system' %}")
    system = Turn("system", (Part("text", "Be terse."),))
    asking = Turn("user", (Part("image"), Part("text", "And this?")))
    written = _prompt(no_system, (system, hi, asking), [("image", (1, 4, 4), 0.0)])
    assert "Be terse." not in written and "Hi." in written and written.count("<|image_pad|>") == 4


@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}{% for p in m.content %}{% endfor %}{{ m.content }}{% endfor %}",
     "writes a message's content, a list of parts, as a string"),
    ("{% for m in messages %}{% for p in m.content %}{% endfor %}{{ m.content + 'x' }}{% endfor %}", "cannot write a message whose content is a list"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text | upper }}{% endfor %}{% endfor %}",
     "does not write the user's text as it is"),
    ("", "does not write the user's text as it is"),
    (SHORT.replace("<|vision_start|><|{{ p.type }}_pad|><|vision_end|>", ""),
     "must write <|image_pad|> then <|video_pad|>, or some of them, once each and in order; it wrote none"),
    (QWEN_OWN.replace("<|image_pad|>", "<|image_pad|><|image_pad|>"), "it wrote ['<|image_pad|>', '<|image_pad|>',"),
    (SHORT.replace("{% for p in m.content %}", "{% for p in m.content | reverse %}"),
     "it wrote ['<|video_pad|>', '<|image_pad|>']"),
])
def test_a_template_that_fails_the_probes_stops_the_load_naming_the_parameter(template, says):
    with pytest.raises(ValueError) as refused:
        with_template(load_tokenizer(None), template, QWEN)
    assert str(refused.value).startswith("parameter chat_template: ") and says in str(refused.value), refused.value


@pytest.mark.parametrize("dropped, kept", [("video", "image"), ("image", "video")])
def test_a_template_for_one_media_kind_is_taken_and_a_request_with_the_other_is_refused(dropped, kept):
    """vLLM starts with a template that places images only (or videos only) and fails the other kind's requests: so
    does the server, its 400 naming the kind (a mixed request too), while the kind it places is served."""
    template = QWEN_OWN.replace(f"<|vision_start|><|{dropped}_pad|><|vision_end|>", "")
    asking = Turn("user", (Part(kept), Part("text", "And this?")))
    grid = {"image": ("image", (1, 4, 4), 0.0), "video": ("video", (2, 4, 4), 1.0)}
    assert f"<|{kept}_pad|>" in _prompt(template, (asking,), [grid[kept]])
    both = Turn("user", (Part("video"), Part("image"), Part("text", "And these?")))
    says = rf"^messages: this server's chat template \(the launcher's --chat-template\) writes no placeholder for a " \
           rf"{dropped} \(<\|{dropped}_pad\|>\), so it cannot take a {dropped} in a message"
    with pytest.raises(InvalidInput, match=says):
        _prompt(template, (both,), [grid["video"], grid["image"]])


def test_a_text_changed_as_it_is_written_is_the_servers_fault_where_the_probes_did_not_show_it():
    shouting = SHORT.replace("{{ p.text }}", "{{ p.text | upper if m.role == 'assistant' else p.text }}")
    hi = Turn("user", (Part("text", "Hi."),))
    with pytest.raises(RuntimeError, match="changed a message's text as it wrote it .*must write each text part as"):
        _prompt(shouting, (hi, Turn("assistant", (Part("text", "Hello."),)), hi))


def test_a_template_that_refuses_conversations_itself_is_taken_and_answers_each_with_a_400():
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('A system message first.') }}{% endif %}" \
             + QWEN_OWN
    with pytest.raises(InvalidInput, match="the chat template refused the conversation .*A system message first"):
        _prompt(strict, (Turn("user", (Part("text", "Hi."),)),))
    with pytest.raises(InvalidInput, match="^chat_template_kwargs: greeting: holds <|image_pad|>"):
        _prompt(QWEN_OWN, (Turn("user", (Part("text", "Hi."),)),),
                options=ChatOptions(template_kwargs=(("greeting", '"<|image_pad|>"'),)))


def test_the_launcher_option_passes_a_files_absolute_path_or_the_template_through_the_config(tmp_path, monkeypatch):
    (tmp_path / "t.jinja").write_text(SHORT)
    monkeypatch.chdir(tmp_path)
    plan = launch_options.serve_plan(argparse.Namespace(config=None, model=None, chat_template="t.jinja",
                                                        chat_template_content_format="string", overrides=[],
                                                        gpu_sharing=None), REPOSITORY)
    assert plan.overrides["orchestrator"]["chat_template"] == str(tmp_path / "t.jinja")
    assert plan.overrides["orchestrator"]["chat_template_content_format"] == "string"
    assert launch_options.template_option(SHORT) == SHORT
    assert launch_options.template_option(QWEN_OWN) == QWEN_OWN  # longer than a file name may be
    with pytest.raises(ValueError, match="^--chat-template: empty"):
        launch_options.template_option(" ")
    with pytest.raises(ValueError, match="^--chat-template: 'nope.jinja' looks like a file path"):
        launch_options.template_option("nope.jinja")
    # the template itself goes into config.pbtxt on one line, its line breaks escaped as the text format has them
    config = 'parameters { key: "chat_template" value { string_value: "" } }\n'
    assert edited_config(config, {"chat_template": 'a\n"b"\\'}) == \
        'parameters { key: "chat_template" value { string_value: "a\\n\\"b\\"\\\\" } }\n'


def test_each_familys_own_template_passes_the_probes_and_another_familys_does_not():
    internvl3 = offline_tokenizer("internvl3_tiny")
    assert with_template(internvl3, internvl3.chat_template, family("internvl3")) is internvl3
    with pytest.raises(ValueError, match="must write <IMG_CONTEXT> then <video>, or some of them, once each"):
        with_template(offline_tokenizer("internvl3_tiny"), QWEN_OWN, family("internvl3"))
