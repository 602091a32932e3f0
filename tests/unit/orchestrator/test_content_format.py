"""A chat template that takes a message's content as one string (vLLM's "string" content format,
orchestrator/content_format.py): told apart from one that reads the parts as vLLM 0.26 tells them, and the prompt it
writes is the one vLLM writes with that template (the media parts' placeholders first, a line each, then the texts)."""
import pytest

from backends.runtime.families.registry import offline_tokenizer
from backends.runtime.tokenizer import load_tokenizer
from flashcodec.families import family
from orchestrator.config import OrchestratorConfig
from orchestrator.content_format import AUTO, OPENAI, STRING, chosen_format, content_format, string_content
from orchestrator.messages import Part, Turn
from orchestrator.prompt import build_chat_prompt
from orchestrator.served_template import with_template

QWEN, INTERNVL3 = family("qwen2_5_vl"), family("internvl3")
# vLLM's examples/template_chatml.jinja, as a text chat's template is written
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
          " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("template, expected", [
    (CHATML, STRING),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", STRING),
    (load_tokenizer(None).chat_template, OPENAI),  # Qwen2.5-VL's own
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", OPENAI),
    ("{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}",
     OPENAI),
    (None, OPENAI),
])
def test_the_content_format_is_told_as_vllm_tells_it(template, expected):
    assert content_format(template) == expected


def test_a_string_content_is_the_media_placeholders_a_line_each_then_the_texts():
    parts = [("text", "a"), ("image", ""), ("text", "b"), ("video", "")]
    assert string_content(parts, QWEN.part_texts) == ("<|vision_start|><|image_pad|><|vision_end|>\n"
                                                     "<|vision_start|><|video_pad|><|vision_end|>\na\nb")
    assert string_content([("text", "a"), ("text", "b")], QWEN.part_texts) == "a\nb"
    assert string_content([("image", "")], INTERNVL3.part_texts) == "<IMG_CONTEXT>\n"


def test_a_chatml_template_serves_an_image_as_vllm_writes_its_prompt():
    tokenizer = with_template(load_tokenizer(None), CHATML, QWEN)  # the probes pass
    turns = (Turn("system", (Part("text", "Be terse."),)),
             Turn("user", (Part("text", "What is"), Part("image"), Part("text", "this?"))))
    prompt = build_chat_prompt(tokenizer, turns, [("image", (1, 4, 4), 0.0)], QWEN)
    content = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>\nWhat is\nthis?"
    expected = (f"<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert list(prompt.input_ids) == tokenizer.encode(expected, add_special_tokens=False)
    assert prompt.media[0].token_offset == prompt.input_ids.index(tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def test_a_chatml_template_passes_the_probes_of_internvl3():
    tokenizer = with_template(offline_tokenizer("internvl3_tiny"), CHATML, INTERNVL3)
    assert content_format(tokenizer.chat_template) == STRING


@pytest.mark.parametrize("template", [CHATML, load_tokenizer(None).chat_template, None])
def test_a_chosen_format_stands_and_auto_tells_it_from_the_template(template):
    assert chosen_format(template, STRING) == STRING and chosen_format(template, OPENAI) == OPENAI
    assert chosen_format(template, AUTO) == content_format(template)


def test_string_chosen_for_the_models_own_template_writes_vllms_string_prompt():
    """Qwen2.5-VL's own template writes a string content as it is (its ``content is string`` branch): with "string"
    chosen (``--chat-template-content-format string``) the prompt is vLLM's for that flag, the placeholder first."""
    tokenizer = with_template(load_tokenizer(None), None, QWEN, STRING)
    turns = (Turn("user", (Part("text", "What is"), Part("image"))),)
    prompt = build_chat_prompt(tokenizer, turns, [("image", (1, 4, 4), 0.0)], QWEN, content=STRING)
    chosen = tokenizer.decode(list(prompt.input_ids))
    assert "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>\nWhat is<|im_end|>" in chosen
    parts = tokenizer.decode(list(build_chat_prompt(tokenizer, turns, [("image", (1, 4, 4), 0.0)], QWEN).input_ids))
    assert "What is<|vision_start|>" in parts  # auto: the parts in their order


def test_openai_chosen_for_a_template_that_takes_a_string_stops_the_load_naming_the_parameter():
    with pytest.raises(ValueError, match="^parameter chat_template_content_format openai \\(the launcher's "
                                         "--chat-template-content-format\\): the template cannot write a message "
                                         "whose content is a list of parts \\(TypeError"):
        with_template(load_tokenizer(None), CHATML, QWEN, OPENAI)


def test_the_orchestrator_parameter_takes_the_three_words_and_names_itself_for_another():
    assert OrchestratorConfig.from_parameters({}).content_format == AUTO
    assert OrchestratorConfig.from_parameters({"chat_template_content_format": "string"}).content_format == STRING
    with pytest.raises(ValueError, match="^parameter chat_template_content_format must be auto, string or openai, "
                                         "got 'strings'"):
        OrchestratorConfig.from_parameters({"chat_template_content_format": "strings"})
