"""Token-exact continuation through the chat template."""
from engine import SamplingParams
from ui.conversation import build_prompt


def test_next_turn_extends_the_exact_tokens_and_hits_the_cache(smol32):
    tok = smol32.get_tokenizer()
    first = build_prompt(tok, "Be brief.", [], "Where is my parcel?", "m")
    assert first.reused == 0 and first.token_ids == smol32.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is my parcel?"}])
    out = smol32.generate([first.token_ids], SamplingParams(temperature=0, max_tokens=30))[0]
    history = [{"role": "user", "content": "Where is my parcel?", "token_ids": first.token_ids, "model": "m"},
               {"role": "assistant", "content": out.outputs[0].text, "token_ids": out.outputs[0].token_ids,
                "model": "m"}]
    second = build_prompt(tok, "Be brief.", history, "Thanks!", "m")
    context = first.token_ids + out.outputs[0].token_ids
    assert second.fallback is None and second.token_ids[:len(context)] == context
    assert tok.decode(second.token_ids) == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is my parcel?"},
         {"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": "Thanks!"}],
        tokenize=False, add_generation_prompt=True)
    turn2 = smol32.generate([second.token_ids], SamplingParams(temperature=0, max_tokens=4))[0]
    assert turn2.num_cached_tokens >= len(context) - 16


def test_model_change_or_edited_history_falls_back_to_a_full_render(smol32):
    tok = smol32.get_tokenizer()
    prompt = build_prompt(tok, "", [], "Hi", "old").token_ids
    history = [{"role": "user", "content": "Hi", "token_ids": prompt, "model": "old"},
               {"role": "assistant", "content": "Hello!", "token_ids": tok.encode("Hello!<|im_end|>"), "model": "old"}]
    assert build_prompt(tok, "", history, "Bye", "old").fallback is None
    changed = build_prompt(tok, "", history, "Bye", "new")
    assert changed.reused == 0 and "model changed" in changed.fallback
    history[1]["content"] = "Hello there!"  # the stored ids no longer match the text
    edited = build_prompt(tok, "", history, "Bye", "old")
    assert edited.reused == 0 and "diverge" in edited.fallback
    assert tok.decode(edited.token_ids).endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_a_reply_cut_by_a_crash_continues_token_exact_even_where_its_text_lagged(smol32):
    """A reply stored mid-stream and then cut (finish_reason interrupted) may hold less text than its
    tokens: the next turn still starts with exactly those tokens. A finished reply whose text differs
    from its tokens is an edit: rendered again from its text."""
    tok = smol32.get_tokenizer()
    prompt = build_prompt(tok, "", [], "Hi", "m").token_ids
    ids = tok.encode("Hello there, my friend", add_special_tokens=False)
    history = [{"role": "user", "content": "Hi", "token_ids": prompt, "model": "m"},
               {"role": "assistant", "content": "Hello there, my fr", "token_ids": ids, "model": "m",
                "finish_reason": "interrupted"}]
    cut = build_prompt(tok, "", history, "Still there?", "m")
    assert cut.fallback is None and cut.token_ids[:len(prompt) + len(ids)] == prompt + ids
    history[1]["finish_reason"] = "stop"
    assert "diverge" in build_prompt(tok, "", history, "Still there?", "m").fallback
