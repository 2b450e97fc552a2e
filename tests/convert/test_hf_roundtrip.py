"""transformers -> from-hf (tp=2, pp=2) -> to-hf; export-encoder; the tokenizer files."""

import json
import os

import pytest
import torch

from megatron_rembert.convert.__main__ import main
from megatron_rembert.convert.hf import hf_config_dict
from megatron_rembert.model.sizes import parameter_counts
from tests.convert.workers import MICRO, overrides
from tests.model.helpers import random_batch, small_config

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
             intermediate_size=96, input_embedding_size=16, output_embedding_size=40,
             max_position_embeddings=64)


def _random_hf(cls=None):
    torch.manual_seed(0)
    cls = cls or transformers.RemBertForMaskedLM
    hf = cls(transformers.RemBertConfig(**hf_config_dict(small_config())))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf.eval()


def test_from_hf_to_hf_round_trip_and_logits(tmp_path):
    hf = _random_hf()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["from-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"),
                 "--tp", "2", "--pp", "2"]) == 0
    assert main(["to-hf", "--checkpoint", str(tmp_path / "ckpt" / "step_00000000"),
                 "--out", str(tmp_path / "back")]) == 0
    back = transformers.RemBertForMaskedLM.from_pretrained(tmp_path / "back").eval()
    ref = hf.state_dict()
    got = back.state_dict()
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(got[name], tensor), name
    # Our trainer (TP=1) loads the from-hf checkpoint: its logits equal transformers'.
    from megatron_rembert.checkpoint.step_folder import read_meta
    from megatron_rembert.model.rembert import RemBertForPreTraining

    config = small_config()
    ours = RemBertForPreTraining(config).eval()
    _load_into_module(ours, tmp_path / "ckpt" / "step_00000000")
    assert read_meta(tmp_path / "ckpt" / "step_00000000")["weights_only"] is True
    batch = random_batch(config)
    with torch.no_grad():
        hidden = ours.rembert(batch["input_ids"], batch["attention_mask"],
                              batch["token_type_ids"])
        logits = ours.mlm_head.logits(hidden.reshape(-1, config.hidden_size))
        ref_logits = back(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          token_type_ids=batch["token_type_ids"]).logits
    diff = (logits[:, : config.vocab_size] - ref_logits.reshape(-1, config.vocab_size))
    assert diff.abs().max() <= 1e-5


def _load_into_module(model, folder):
    """Every weight of a portable checkpoint, as the trainer's loader reads it (each TP rank's
    slice of the full tensor, here the one rank of tp 1)."""
    from megatron_rembert.checkpoint.portable import PortableReader
    from megatron_rembert.checkpoint.specs import ParamSpec

    layers = model.config.num_hidden_layers
    with PortableReader(folder) as reader, torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reader.local_shard(name, ParamSpec.of(name, param, layers), 1, 0))


@pytest.mark.multiprocess
def test_from_hf_loads_in_trainer_at_tp2_pp2(tmp_path):
    """Our pipeline trainer at tp=2 x pp=2 gives transformers' loss on the converted model."""
    from tests.convert.workers import eval_worker
    from tests.distributed import run_distributed

    hf = _random_hf()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["from-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"),
                 "--tp", "2", "--pp", "2"]) == 0
    config = small_config()
    batch = random_batch(config, batch=4, seq=16, predictions=3)
    batch["masked_weights"][1, -1] = 1.0
    labels = torch.full_like(batch["input_ids"], -100)
    labels.scatter_(1, batch["masked_positions"], batch["masked_labels"])
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 token_type_ids=batch["token_type_ids"], labels=labels).loss.item()
    model = {"preset": "tiny", **SMALL}
    over = [o for o in overrides(2, 2) if not o.startswith("train.global")]
    over += [f"train.global_batch_size={len(batch['input_ids'])}", "data.seq_length=16"]
    loss = run_distributed(eval_worker, 4, model, over,
                           str(tmp_path / "ckpt" / "step_00000000"), batch, timeout=300)[0]
    assert MICRO == 2
    assert loss == pytest.approx(ref, rel=1e-5)


def test_bare_encoder_gets_fresh_head_and_export_encoder_counts(tmp_path, capsys):
    _random_hf(transformers.RemBertModel).save_pretrained(tmp_path / "enc")
    assert main(["from-hf", "--model", str(tmp_path / "enc"), "--out", str(tmp_path / "ckpt"),
                 "--seed", "7"]) == 0
    assert "no MLM head" in capsys.readouterr().out
    assert main(["export-encoder", "--checkpoint", str(tmp_path / "ckpt" / "step_00000000"),
                 "--out", str(tmp_path / "encoder")]) == 0
    counts = parameter_counts(small_config())
    printed = capsys.readouterr().out
    assert f"{counts.pretraining:,} -> encoder {counts.finetuning:,}" in printed
    enc = transformers.RemBertModel.from_pretrained(tmp_path / "encoder", add_pooling_layer=False)
    assert sum(p.numel() for p in enc.parameters()) == counts.finetuning
    assert json.loads((tmp_path / "encoder" / "config.json").read_text())["architectures"] == [
        "RemBertModel"]


def test_tokenizer_files_match_sentencepiece(tmp_path):
    import sentencepiece as spm

    from megatron_rembert.convert.tokenizer_files import write_tokenizer
    from megatron_rembert.prep.demo_corpus import make_demo_corpus
    from megatron_rembert.prep.tokenizer import train_tokenizer

    make_demo_corpus(tmp_path / "corpus", size_mb=0.1)
    train_tokenizer(tmp_path / "corpus", tmp_path / "spm", vocab_size=1000, num_threads=1)
    out = tmp_path / "tok"
    out.mkdir()
    write_tokenizer(tmp_path / "spm.model", out, 64)
    os.environ["HF_HUB_OFFLINE"] = "1"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    for text in ["Hello world, this is a test.", "  Grüße   aus  Köln ", "ｆｕｌｌ width ①"]:
        assert tok(text)["input_ids"] == [2] + sp.encode(text) + [3], text
    assert (tok.pad_token_id, tok.mask_token_id, tok.unk_token_id) == (0, 4, 1)
