"""sample.py (decoding with a KV cache) and skipview.py (how many blocks each token ran)."""

import json
import math
import os
import re
import shutil
from dataclasses import asdict, replace

import pytest
import torch

import hub
import sample
import sources
import train_gpt as tg
from conftest import (
    AUTHORS_TINY,
    RESUME_RUN,
    another_job_locks,
    load_command,
    logits_gates,
    mor_model,
    run_main,
    spread_gates,
    tiny,
)
from data import shards

# ------------------------------------------------------------------------ sample.py


def test_generate_samples_reproducibly_and_reports_the_cache():
    torch.manual_seed(0)
    model = tg.GPT(tiny(n_layers=2, max_seq_len=16, seq_len=16, gate_init="zero"))
    a, cache = sample.generate(model, [1, 2, 3], 10, temperature=0.8, top_k=20, seed=5)
    b, _ = sample.generate(model, [1, 2, 3], 10, temperature=0.8, top_k=20, seed=5)
    assert a == b and len(a) == 13 and a[:3] == [1, 2, 3] and all(0 <= t < 97 for t in a)
    assert cache.n == [12, 12]  # zero gates: every token runs every block (the last is not fed)
    # room for the prompt and the tokens, not the whole context (a long max_seq_len: memory)
    assert cache.k.shape[2] == cache.log_g.shape[1] == 13 < model.hp.max_seq_len
    huge = tg.GPT(model.hp)  # finite weights whose logits are not: no token drawn, or made up
    big = {k: model.state_dict()[k] * 1e36 for k in ("head.weight", "head_norm.weight")}
    huge.load_state_dict({**model.state_dict(), **big})
    for temperature in (0.8, 0):
        with pytest.raises(tg.UserError, match="logits after 3 tokens are not all finite"):
            sample.generate(huge, [1, 2, 3], 10, temperature=temperature)
    assert len(sample.generate(model, [1] * 6, 10)[0]) == 16  # max_seq_len exactly
    for prompt, new in (([1] * 7, 10), ([], 5)):  # a token past it; no prompt
        with pytest.raises(tg.UserError, match=r"prompt \+ new tokens <= max_seq_len \(16\)"):
            sample.generate(model, prompt, new)
    # a temperature too small for float32 logits / T: the likeliest token, as greedy decoding
    greedy, _ = sample.generate(model, [1, 2, 3], 10, temperature=0)
    assert sample.generate(model, [1, 2, 3], 10, temperature=1e-40)[0] == greedy
    # greedy decoding through the cache appends what the full forward pass's last position
    # ranks first, each time (weights large enough that the positions decide it)
    torch.manual_seed(0)
    hp = tiny(n_layers=2, max_seq_len=16, seq_len=16, gate_init="zero", init_std=0.5)
    sharp, want = tg.GPT(hp).eval(), [1, 2, 3]
    with torch.no_grad():
        while len(want) < 13:
            want.append(int(sharp(torch.tensor([want])).logits[0, -1].argmax()))
    assert sample.generate(sharp, [1, 2, 3], 10, temperature=0)[0] == want


def test_sampling_draws_among_the_top_k_at_the_temperature_by_the_seed():
    # each sampled token among the top_k of the full forward pass's logits at its position; at a
    # temperature that flattens them, more than the likeliest; top_k past the vocabulary is all
    # of it; the seed decides the draw; a temperature whose float32 would be 0 is greedy, and one
    # whose float64 is denormal
    torch.manual_seed(0)
    model = tg.GPT(tiny(n_layers=2, max_seq_len=16, seq_len=16, gate_init="zero")).eval()
    tokens, _ = sample.generate(model, [1, 2, 3], 13, temperature=1e3, top_k=2, seed=1)
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0]
    top2 = logits.topk(2).indices[2:]  # (the positions that sampled)
    assert all(t in top for t, top in zip(tokens[3:], top2.tolist(), strict=True))
    assert any(t != top[0] for t, top in zip(tokens[3:], top2.tolist(), strict=True))
    everything = sample.generate(model, [1, 2, 3], 13, temperature=1e3, top_k=0, seed=1)[0]
    assert sample.generate(model, [1, 2, 3], 13, temperature=1e3, top_k=97, seed=1)[0] == everything
    assert (
        sample.generate(model, [1, 2, 3], 13, temperature=1e3, top_k=1000, seed=1)[0] == everything
    )
    assert sample.generate(model, [1, 2, 3], 13, temperature=1e3, seed=2)[0] != everything
    greedy = sample.generate(model, [1, 2, 3], 13, temperature=0)[0]
    for tiny_t in (1e-50, 1e-320):  # (1e-320: logits / T would overflow float64)
        assert sample.generate(model, [1, 2, 3], 13, temperature=tiny_t)[0] == greedy, tiny_t
    assert sample.generate(model, [1, 2, 3], 13, top_k=1, seed=4)[0] == greedy


def test_each_draw_is_from_the_softmax_at_the_temperature_over_the_top_k(monkeypatch):
    # the distribution each token is drawn from, at ordinary temperatures: softmax(logits / T)
    # of the full forward pass's logits at its position, over their top_k (the rest 0)
    torch.manual_seed(0)
    model = tg.GPT(tiny(n_layers=2, max_seq_len=16, seq_len=16, init_std=0.3)).eval()
    drawn, draw = [], torch.multinomial

    def recording(probs, *args, **kwargs):
        drawn.append(probs.detach().clone())
        return draw(probs, *args, **kwargs)

    monkeypatch.setattr(sample.torch, "multinomial", recording)
    for temperature, top_k in ((0.5, 0), (0.8, 5), (2.0, 5)):
        drawn.clear()
        tokens, _ = sample.generate(model, [1, 2, 3], 8, temperature=temperature, top_k=top_k)
        with torch.no_grad():
            logits = model(torch.tensor([tokens[:-1]])).logits[0, 2:].double()  # (8, V)
        if top_k:
            logits[logits < logits.topk(top_k, dim=-1).values[:, -1:]] = -math.inf
        want = torch.softmax(logits / temperature, dim=-1)
        assert len(drawn) == 8 and (torch.stack(drawn) - want).abs().max().item() < 1e-4


def test_the_sampler_prints_what_its_options_draw_and_what_its_cache_holds(tmp_path, capsys):
    # a byte model whose gates skip, as a model folder: the command's text is greedy (by full
    # forward passes, written here) at temperature 0 and at top_k 1, and generate's draw for the
    # temperature, top_k and seed given, another seed's another; its cache line gives the
    # cache's entries, their share of a dense cache, and each block's, in block order
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = tg.GPT(tiny(encoding="bytes", vocab_size=256, max_seq_len=64)).eval()
    spread_gates(model, std=0.5, bias=0.0)
    source = tmp_path / "model"
    source.mkdir()
    save_file(model.state_dict(), source / "model.safetensors")
    config = {"format": hub.FORMAT, "settings": asdict(model.hp)}  # (hub.py's own layout)
    (source / "config.json").write_text(json.dumps(config))
    sampler, prompt = load_command("sample.py"), list(b"The")
    enc = sampler.encoding("bytes", 256)

    def command(*options):
        argv = [f"--init_from={source}", "--prompt=The", "--tokens=12", *options]
        code, out, err = run_main(argv, capsys, sampler.main)
        assert code == 0, err
        return out, err

    greedy = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
    assert command("--temperature=0")[0] == command("--top_k=1")[0] == enc.decode(greedy) + "\n"
    drawn = {}
    for T, k, seed in ((2.0, 200, 3), (1.0, 0, 3), (1.0, 0, 4), (0.8, 5, 3)):
        text, err = command(f"--temperature={T}", f"--top_k={k}", f"--seed={seed}")
        tokens, cache = sample.generate(model, prompt, 12, T, k, seed)
        assert text == enc.decode(tokens) + "\n", (T, k, seed)
        drawn[(T, k, seed)] = text
        held, dense, share, blocks = re.search(
            r"KV cache: (\d+) of (\d+) entries \(([\d.]+)% of a dense cache\); per block (.*)", err
        ).groups()
        assert (int(held), int(dense)) == (sum(cache.n), model.hp.n_layers * (len(tokens) - 1))
        assert float(share) == round(100 * sum(cache.n) / int(dense), 1)
        assert blocks == str(cache.n) and cache.n != sorted(cache.n, reverse=True), cache.n
    assert len(set(drawn.values())) == len(drawn)


def test_the_sampler_never_draws_an_id_its_tokenizer_lacks(tmp_path, capsys):
    # a GPT-2 model padded to 50304 ids (nanoGPT's size) whose padding ids are the likeliest:
    # sample.py draws among the tokenizer's 50257 alone, greedy or not (decoding one of the
    # others raised KeyError)
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = tg.GPT(tiny(vocab_size=50304, gate_init="zero")).eval()
    with torch.no_grad():
        model.head.weight[50257:] *= 1e4
    assert int(sample.generate(model, [1, 2], 1, temperature=0)[0][-1]) >= 50257  # as it is
    source = tmp_path / "model"
    source.mkdir()
    save_file(model.state_dict(), source / "model.safetensors")
    config = {"format": hub.FORMAT, "settings": asdict(model.hp)}
    (source / "config.json").write_text(json.dumps(config))
    sampler = load_command("sample.py")
    enc = sampler.encoding("gpt2")
    greedy, drawn = ["--temperature=0"], ["--temperature=1", "--top_k=0", "--seed=3"]
    for options, draw in ((greedy, (0, 0, 0)), (drawn, (1, 0, 3))):  # (temperature, top_k, seed)
        tokens, _ = sample.generate(model, enc.encode_ordinary("Hi"), 8, *draw, vocab=50257)
        assert max(tokens) < 50257, tokens
        argv = [f"--init_from={source}", "--prompt=Hi", "--tokens=8", *options]
        code, out, err = run_main(argv, capsys, sampler.main)
        assert code == 0, err
        assert out.splitlines()[0] == enc.decode(tokens)


@pytest.mark.parametrize("axis", ["key", "query"])
def test_incremental_decoding_matches_a_full_forward_pass(axis):
    torch.manual_seed(0)
    hp = tiny(n_layers=4, dim=48, max_seq_len=24, seq_len=24, compact=axis == "key", gate_axis=axis)
    model = tg.GPT(hp).eval()
    for gate in model.router.gates:
        torch.nn.init.normal_(gate.weight, std=0.15)
        torch.nn.init.constant_(gate.bias, 0.1)
    idx = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, gates = logits_gates(model, idx)
        dense_masked = tg.GPT(replace(hp, compact=False)).eval()
        dense_masked.load_state_dict(model.state_dict())
        masked = dense_masked(idx).logits
    cache = sample.KVCache(hp, "cpu", 24)
    for pos in range(24):
        with torch.no_grad():
            step = model(idx[:, pos : pos + 1], pos=torch.tensor([[pos]]), cache=cache).logits
        assert (step[0, -1] - full[0, pos]).abs().max().item() < 1e-4
        assert (step[0, -1] - masked[0, pos]).abs().max().item() < 1e-4
    assert (gates == 0).any()
    if axis == "query":  # a skipped token is still attended to: every block keeps its K/V
        assert cache.n == [24] * 4
        return
    # each block keeps K/V only for the tokens whose gate there is non-zero
    assert cache.n == [(gates[layer, 0] > 0).sum().item() for layer in range(4)]
    assert sum(cache.n) < 4 * 24 and min(cache.n) > 0


# ---------------------------------------------------------------------- skipview.py


class TokenSpans(__import__("html.parser").parser.HTMLParser):
    """Collects the text and title of each <span class="t"> (one per token)."""

    def __init__(self):
        super().__init__()
        self.spans, self.inside, self.external = [], False, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "link", "img") or "src" in attrs or "href" in attrs:
            self.external.append(tag)
        if tag == "span" and attrs.get("class") == "t":
            self.spans.append(["", attrs["title"]])
            self.inside = True

    def handle_endtag(self, tag):
        self.inside = self.inside and tag != "span"

    def handle_data(self, data):
        if self.inside:
            self.spans[-1][0] += data


def test_skipview_page_has_one_element_per_token_with_its_depth(tmp_path, capsys):
    skipview = load_command("skipview.py")
    run = tmp_path / "run"
    # gate weights wide enough that some tokens skip blocks (g = 0) and others none; 4 blocks:
    # the middle two run fewer tokens than the outer two
    wide = ["--init_std=0.2", "--n_layers=4", f"--run_dir={run}", "--stop_step=4"]
    code, _, err = run_main(RESUME_RUN + wide, capsys)
    assert code == 0, err
    text = "The gate decides, per token, how many blocks run.\nA second line & <markup>."
    page = tmp_path / "page.html"
    code, terminal, err = run_main(
        [str(run), f"--text={text}", f"--out={page}"], capsys, skipview.main
    )
    assert code == 0, err
    parser = TokenSpans()
    parser.feed(page.read_text())
    ids = shards.gpt2_encoding().encode_ordinary(text)
    assert len(parser.spans) == len(ids) and not parser.external
    assert "".join(t for t, _ in parser.spans) == text  # every token, in order, unescaped
    # the counts against the gates computed here: blocks with g > 0 per token
    ckpt = sources.load_checkpoint(str(run))
    model = tg.GPT(tg.Hyperparameters(**ckpt["hp"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    with torch.no_grad():
        gates = model(torch.tensor([ids])).route["gates"][:, 0]  # (L, T)
    expected = (gates > 0).sum(0).tolist()
    assert len(set(expected)) > 1, expected  # (one count for all would test nothing)
    assert [int(title.split()[0]) for _, title in parser.spans] == expected
    assert "⏎" in terminal and terminal.count("[") >= len(ids)
    per_block = (gates > 0).sum(1).tolist()  # in block order, in the terminal and the table
    assert per_block != sorted(per_block, reverse=True), per_block
    assert f"; per block: {per_block}\n" in terminal
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td>", page.read_text())
    assert rows == [(str(i), str(n)) for i, n in enumerate(per_block)]
    page = tmp_path / "val.html"  # the validation shard's first 7 tokens
    code, out, err = run_main([str(run), "--val_tokens=7", f"--out={page}"], capsys, skipview.main)
    assert code == 0 and "\ntokens 7; blocks run per token" in out, err
    parser = TokenSpans()
    parser.feed(page.read_text())
    first = shards.read_shard(shards.find_shards(model.hp.val_files)[0], 50257)[:7].tolist()
    pieces = skipview.token_pieces(shards.gpt2_encoding(), first)
    assert [t for t, _ in parser.spans] == pieces
    for argv in ([str(run), "--val_tokens=0"], [str(run), f"--out={tmp_path}"]):
        code, _, err = run_main(argv, capsys, skipview.main)
        assert code == 2 and err.count("error: ") == 1, err
    training = another_job_locks(run)  # a page into a folder that a job holds (a run training)
    try:  # refused before the work (no view printed), not at its write
        argv = [str(run), "--text=a", f"--out={run / 'p.html'}"]
        code, out, err = run_main(argv, capsys, skipview.main)
    finally:
        os.close(training)
    assert code == 2 and out == "" and err.startswith(f"error: {run} is in use by another job"), err
    # validation shards whose first is empty (a traceback): the tokens after it, as a model
    # folder whose settings name them
    from safetensors.torch import save_file

    folder, empty = tmp_path / "model", tmp_path / "v_0.bin"
    folder.mkdir()
    empty.write_bytes(shards.header(0))
    shutil.copy(shards.find_shards(model.hp.val_files)[0], tmp_path / "v_1.bin")
    save_file(model.state_dict(), folder / "model.safetensors")
    settings = {**asdict(model.hp), "val_files": str(tmp_path / "v_*.bin")}
    (folder / "config.json").write_text(json.dumps({"format": hub.FORMAT, "settings": settings}))
    page = tmp_path / "after_empty.html"
    argv = [f"--init_from={folder}", "--val_tokens=7", f"--out={page}"]
    code, _, err = run_main(argv, capsys, skipview.main)
    assert code == 0, err
    parser = TokenSpans()
    parser.feed(page.read_text())
    assert [t for t, _ in parser.spans] == pieces


def test_skipview_counts_the_recursions_each_token_ran():
    skipview = load_command("skipview.py")
    model = mor_model().train()  # (token_depths routes as inference does; MoR trains otherwise)
    counts, per_recursion, units = skipview.token_depths(model, list(range(16)), "cpu")
    with torch.no_grad():
        blocks = model.eval()(torch.tensor([list(range(16))])).route["block"][:, 0].sum(0).tolist()
    # blocks 0 and 7, then 2 per recursion
    assert units == 3 and [2 + 2 * c for c in counts] == blocks
    assert per_recursion == sorted(per_recursion, reverse=True) and 0 < per_recursion[2] < 16


def test_skipview_page_and_terminal_view_by_hand():
    # the hue from red (0: no unit run) to blue (220: every unit), rounded; the page's spans,
    # legend (0 to every unit), title and per-unit shares of the tokens, text escaped
    skipview = load_command("skipview.py")
    hsl = [f"hsl({hue}, 70%, 85%)" for hue in (0, 73, 147, 220)]
    assert [skipview.colour(c, 3) for c in range(4)] == hsl
    assert skipview.colour(0, 0) == hsl[0]
    pieces, counts = ["<i>", "&amp;", "\n", "c"], [0, 2, 3, 3]
    page = skipview.html_page(pieces, counts, [3, 2, 1], 3, "<run> & co", "blocks")
    spans = re.findall(r'<span class="t" style="background:([^"]+)" title="([^"]+)">', page)
    assert spans == [(hsl[c], f"{c} of 3 blocks") for c in counts]
    parser = TokenSpans()
    parser.feed(page)
    assert [text for text, _ in parser.spans] == pieces
    legend = re.findall(r'<span class="k" style="background:([^"]+)">(\d+)</span>', page)
    assert legend == [(hsl[c], str(c)) for c in range(4)]
    assert "<title>&lt;run&gt; &amp; co</title>" in page and "<h1>&lt;run&gt; &amp; co</h1>" in page
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>([^<]+)</td></tr>", page)
    assert rows == [("0", "3", "75.0%"), ("1", "2", "50.0%"), ("2", "1", "25.0%")]  # (of 4)
    assert skipview.terminal_view(pieces, counts) == "<i>[0]&amp;[2]⏎[3]c[3]"


def test_skipview_shows_a_character_split_over_gpt2_tokens_once_at_its_first_byte():
    # GPT-2 BPE holds 日, 本 and 語 (3 bytes each) in a token of two bytes and one of the third;
    # decoded one token at a time, each half would show as U+FFFD
    skipview, enc = load_command("skipview.py"), shards.encoding("gpt2", 50257)
    ids = enc.encode_ordinary("日本語のテキスト")
    assert [len(enc.decode_bytes([i])) for i in ids] == [2, 1, 2, 1, 2, 1, 3, 3, 3, 6]
    want = ["日", "", "本", "", "語", "", "の", "テ", "キ", "スト"]
    assert skipview.token_pieces(enc, ids) == want


def test_a_prompt_reads_the_separator_and_refuses_bytes_gpt2_cannot_encode(tmp_path, capsys):
    # <|endoftext|> in a prompt is the separator, as tiktoken's encode with it allowed (and
    # nanoGPT's sample.py) has it, and skipview's --text alike; a byte model keeps a command
    # line's stray bytes, GPT-2 refuses them
    sampler = load_command("sample.py")
    gpt2, byte = shards.encoding("gpt2", 50257), shards.encoding("bytes", 256)
    for text in ("a<|endoftext|>b", "<|endoftext|><|endoftext|> x", "é<|endoftext|>"):
        want = gpt2.encode(text, allowed_special={"<|endoftext|>"})
        assert shards.text_ids(gpt2, text, "--prompt") == want, text
    assert shards.text_ids(byte, "é<|endoftext|>\udcff", "--prompt") == [*"é".encode(), 0, 255]
    model = [f"--init_from={AUTHORS_TINY}", "--temperature=0", "--tokens=3"]
    code, _, err = run_main([*model, "--prompt=a<|endoftext|>"], capsys, sampler.main)
    assert code == 0 and " of 16 entries " in err, err  # 2 prompt tokens + 3, 4 fed, 4 blocks
    code, _, err = run_main([*model, "--prompt=é\udcffa"], capsys, sampler.main)
    assert code == 2 and err == (
        "error: --prompt is not UTF-8 from byte 2 on, and GPT-2's BPE encodes text alone\n"
    )
    skipview = load_command("skipview.py")  # (its --text as the prompt)
    argv = [f"--init_from={AUTHORS_TINY}", "--text=a<|endoftext|>b", f"--out={tmp_path / 'p.html'}"]
    code, out, err = run_main(argv, capsys, skipview.main)
    assert code == 0 and "\ntokens 3; blocks run per token" in out, err


def test_the_commands_start_from_the_separator_and_keep_to_the_context(tmp_path, capsys):
    # the authors' tiny model (GPT-2 tokens, a 64-token context): an empty prompt is
    # <|endoftext|>; a prompt of 60 tokens leaves room for 4 (63 fed to each of 4 blocks); a
    # text past the context is cut to it
    sampler, skipview = load_command("sample.py"), load_command("skipview.py")
    model = [f"--init_from={AUTHORS_TINY}", "--temperature=0"]
    code, out, err = run_main([*model, "--prompt=", "--tokens=3"], capsys, sampler.main)
    assert code == 0 and out.startswith("<|endoftext|>"), err
    prompt = "a" + " a" * 59
    assert len(shards.gpt2_encoding().encode_ordinary(prompt)) == 60
    code, _, err = run_main([*model, f"--prompt={prompt}", "--tokens=10"], capsys, sampler.main)
    assert (
        code == 0 and "sampling 4 after the 60-token prompt" in err and " of 252 entries " in err
    ), err
    for words, status, said in ((63, 0, "sampling 1 after the 63-token prompt"), (64, 2, "no tok")):
        argv = [*model, "--prompt=a" + " a" * (words - 1), "--tokens=9"]
        code, _, err = run_main(argv, capsys, sampler.main)
        assert code == status and said in err, (words, err)  # (the context: 64)
    page = tmp_path / "page.html"
    argv = [f"--init_from={AUTHORS_TINY}", "--text=" + " word" * 100, f"--out={page}"]
    code, out, err = run_main(argv, capsys, skipview.main)
    assert code == 0 and "\ntokens 64; blocks run per token" in out, err
    assert page.read_text().count('<span class="t"') == 64
