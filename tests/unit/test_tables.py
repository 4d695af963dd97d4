"""Table data sets (data/tables.py): a Parquet set and a saved DatasetDict read as the folder they
were made of, sample for sample; each kind of bad row named by its file and row."""

import hashlib
import io
import json
import shutil
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from table_data import table_dataset, table_rows, with_features, write_table_set

from ddptrain.config import Config
from ddptrain.data import check, shard_index, tables
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import FolderSource, open_source
from ddptrain.data.tables import TableSource
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError

ONE = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def source(root, **settings) -> TableSource:
    opened = open_source(Config(data=str(root), **settings))
    assert isinstance(opened, TableSource)
    return opened


def assert_same_samples(table, folder) -> None:
    assert table.class_to_idx == folder.class_to_idx
    assert len(table.dataset) == len(folder.dataset)
    for i in range(len(folder.dataset)):
        (image, label), (expected, target) = table.dataset[i], folder.dataset[i]
        assert torch.equal(image, expected) and label == target


@pytest.mark.parametrize("form", ["tiny_parquet", "tiny_dataset_dict"])
def test_a_table_set_reads_as_the_folder_it_was_made_of(form, tiny_data, request):
    table, folder = source(request.getfixturevalue(form)), FolderSource(tiny_data)
    for split in ("train", "val"):
        assert_same_samples(table.split(split), folder.split(split))
        assert table.split(split).facts["images"] == folder.split(split).facts["images"]


def test_rows_are_named_by_split_file_and_row(tiny_parquet, tiny_dataset_dict):
    names = source(tiny_parquet).names()
    assert names[:2] == ["train/part-0.parquet:0", "train/part-0.parquet:1"]
    assert names[9:11] == ["train/part-0.parquet:9", "train/part-1.parquet:0"]
    assert len(names) == 39 and names[-1] == "val/part-0.parquet:14"
    saved = source(tiny_dataset_dict)
    assert saved.names(("val",))[0] == "val/data-00000-of-00001.arrow:0"
    # The split is ddptrain's (val), the file where save_to_disk put it (validation/).
    shown = saved.shown("val/data-00000-of-00001.arrow:3")
    assert shown == f"{tiny_dataset_dict}/validation/data-00000-of-00001.arrow:3"


def test_each_file_is_opened_once_and_few_row_groups_are_kept(tiny_parquet, monkeypatch):
    assert pq.ParquetFile(tiny_parquet / "train" / "part-0.parquet").num_row_groups == 3
    group = pq.ParquetFile(tiny_parquet / "train" / "part-0.parquet").read_row_group(0)
    limit = 2 * group.column("image").nbytes  # of the 7 row groups, about 2
    monkeypatch.setattr(tables, "GROUPS_KEPT_BYTES", limit)
    train = source(tiny_parquet).split("train").dataset
    opened = []
    real = tables._Parquet.__init__

    def counted(self, path):
        opened.append(path)
        real(self, path)

    monkeypatch.setattr(tables._Parquet, "__init__", counted)
    for index in torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist():
        train[index]
        kept = train.open.groups.values()
        assert sum(v.nbytes for v in kept) <= limit or len(kept) == 1
    assert sorted(opened) == sorted(tiny_parquet.glob("train/*.parquet"))


def test_facts_change_with_the_labels(tiny_data, tiny_parquet, tmp_path):
    data = shutil.copytree(tiny_parquet, tmp_path / "data")
    before = source(data).split("train").facts
    changed = table_dataset(tiny_data, "train").select(range(10))
    changed = changed.map(lambda row: {"label": (row["label"] + 1) % 3})
    changed.to_parquet(data / "train" / "part-0.parquet")
    after = source(data).split("train").facts
    assert after["images"] == before["images"] and after["digest"] != before["digest"]


def test_the_digest_is_of_the_rows_in_order_as_checkpoints_hold_it(tiny_parquet):
    """Table checkpoints hold this digest: another definition (folder.digest's sorted pairs)
    would stop every one of them resuming on the same data."""
    split = source(tiny_parquet).split("val")
    names = [f"val/part-0.parquet:{row}" for row in range(15)]
    listed = "".join(
        f"{n}\t{label}\n" for n, label in zip(names, split.dataset.targets, strict=True)
    )
    assert split.facts["digest"] == hashlib.sha256(listed.encode()).hexdigest()


@pytest.mark.parametrize("filename", ["../x.arrow", "/etc/passwd", "a/b.arrow", "..", "", 5])
def test_a_state_json_file_outside_its_split_is_refused(tiny_dataset_dict, tmp_path, filename):
    data = shutil.copytree(tiny_dataset_dict, tmp_path / "data")
    state = data / "train" / "state.json"
    listed = json.loads(state.read_text())
    shutil.copy(state.parent / listed["_data_files"][0]["filename"], data / "x.arrow")  # readable
    listed["_data_files"][0]["filename"] = filename
    state.write_text(json.dumps(listed))
    with pytest.raises(UserError) as raised:
        source(data).split("train")
    assert (
        str(raised.value) == f"DATA: {state} lists {filename!r}, not a file name in {state.parent}"
    )


def test_labels_without_a_class_label(tiny_data, tmp_path):
    rows, _ = table_rows(tiny_data, "val")
    write_table_set(tmp_path / "ints", datasets.Dataset.from_dict(rows))  # int64 labels 0..2
    assert source(tmp_path / "ints").split("val").class_to_idx == {"0": 0, "1": 1, "2": 2}
    rows["label"] = [["bar", "arrow", "circle"][label] for label in rows["label"]]
    write_table_set(tmp_path / "strings", datasets.Dataset.from_dict(rows))
    split = source(tmp_path / "strings").split("val")
    assert split.class_to_idx == {"arrow": 0, "bar": 1, "circle": 2}  # sorted, as folders are
    labels = [split.dataset[i][1] for i in range(len(split.dataset))]
    assert labels == [[1, 0, 2][label] for label in table_rows(tiny_data, "val")[0]["label"]]


@pytest.mark.parametrize(
    ("label", "class_label", "message"),
    [
        (-1, True, "label -1 is out of range: the classes are 0..2 (its ClassLabel's names)"),
        (7, False, None),  # without a ClassLabel, 7 makes 8 classes: no error
        (-3, False, "label -3 is out of range: the classes are 0..2"),
        (None, False, "no label (null in column 'label')"),
        (
            10**9,  # would be a billion class names
            False,
            "label 1000000000, and without a ClassLabel a label must be below 1,000,000 (the "
            "split's number of rows or 1,000,000, the larger): give column 'label' a ClassLabel "
            "naming the classes",
        ),
    ],
)
def test_a_bad_label_is_named_by_file_and_row(tiny_data, tmp_path, label, class_label, message):
    rows, classes = table_rows(tiny_data, "val")
    rows["label"][4] = label
    names = datasets.ClassLabel(names=classes) if class_label else datasets.Value("int64")
    features = datasets.Features({"image": datasets.Image(), "label": names})
    write_table_set(tmp_path, datasets.Dataset.from_dict(rows, features=features))
    if message is None:
        assert len(source(tmp_path).split("val").class_to_idx) == 8
        return
    with pytest.raises(UserError, match=rf"^{tmp_path / 'train' / 'part-0.parquet'}:4: "):
        source(tmp_path).names()
    with pytest.raises(UserError) as raised:
        source(tmp_path).split("val")
    assert str(raised.value) == f"{tmp_path / 'val' / 'part-0.parquet'}:4: {message}"


def test_labels_without_a_class_label_are_bounded_as_pack_bounds_them(
    tiny_data, tmp_path, monkeypatch
):
    """Below the split's number of rows or MAX_CLASSES, the larger: 15 rows against 10 here."""
    monkeypatch.setattr(shard_index, "MAX_CLASSES", 10)
    rows, _ = table_rows(tiny_data, "val")
    rows["label"][4] = 14
    write_table_set(tmp_path / "below", datasets.Dataset.from_dict(rows))
    assert len(source(tmp_path / "below").split("val").class_to_idx) == 15
    rows["label"][4] = 15
    write_table_set(tmp_path / "at", datasets.Dataset.from_dict(rows))
    with pytest.raises(UserError, match=r"^.*/val/part-0.parquet:4: label 15, .* below 15 \("):
        source(tmp_path / "at").split("val")


def with_huggingface(data, metadata):
    """The set's Parquet files with `metadata` (bytes, or JSON to write) as their schema's
    `huggingface` metadata, where datasets keeps its features: as another writer may leave it."""
    raw = metadata if isinstance(metadata, bytes) else json.dumps(metadata).encode()
    for path in data.glob("*/*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.replace_schema_metadata({b"huggingface": raw}), path)
    return data


def label_feature(feature) -> dict:
    return {"info": {"features": {"image": {"_type": "Image"}, "label": feature}}}


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["arrow", "bar", "arrow"], "names 'arrow' twice"),
        (["arrow", "", "circle"], "has the class name ''"),
        (["arrow", 1, "circle"], "has the class name 1"),
    ],
)
def test_class_label_names_are_distinct_non_empty_strings(tiny_parquet, tmp_path, names, message):
    data = shutil.copytree(tiny_parquet, tmp_path / "data")
    with_huggingface(data, label_feature({"_type": "ClassLabel", "names": names}))
    with pytest.raises(UserError) as raised:
        check.check_command(str(data), workers=0, max_image_pixels=10**8)
    assert str(raised.value) == (
        f"{data / 'train' / 'part-0.parquet'}: the ClassLabel of column 'label' {message}: "
        "give each class one distinct, non-empty name"
    )


NOT_DATASETS = "is not a JSON object as datasets writes it: write the file with datasets, or "
NO_NAMES = (
    "the ClassLabel of column 'label' has no list of class names (\"names\"): give it the "
    "names, as datasets.ClassLabel(names=[...]) writes them"
)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (b"{not JSON", f"the schema metadata huggingface {NOT_DATASETS}"),
        (b"[]", f"the schema metadata huggingface {NOT_DATASETS}"),
        ({"info": ["features"]}, f"the schema metadata huggingface.info {NOT_DATASETS}"),
        (
            {"info": {"features": "x"}},
            f"the schema metadata huggingface.info.features {NOT_DATASETS}",
        ),
        (
            label_feature("ClassLabel"),
            f"the schema metadata huggingface.info.features.label {NOT_DATASETS}",
        ),
        (label_feature({"_type": "ClassLabel"}), NO_NAMES),
        (label_feature({"_type": "ClassLabel", "names": 3}), NO_NAMES),
        (label_feature({"_type": "ClassLabel", "names": "arrow bar circle"}), NO_NAMES),
    ],
)
def test_malformed_features_are_one_line_naming_the_file(tiny_parquet, tmp_path, metadata, message):
    data = with_huggingface(shutil.copytree(tiny_parquet, tmp_path / "data"), metadata)
    with pytest.raises(UserError) as raised:
        check.check_command(str(data), workers=0, max_image_pixels=10**8)
    assert str(raised.value).startswith(f"{data / 'train' / 'part-0.parquet'}: {message}")


def test_features_datasets_leaves_out_are_no_class_label(tiny_parquet, tmp_path):
    """As datasets reads them: without info.features (or the label's) the labels are plain."""
    for metadata in ({}, {"info": {}}, {"info": {"features": None}}, label_feature(None)):
        data = with_huggingface(shutil.copytree(tiny_parquet, tmp_path / "data"), metadata)
        assert source(data).split("val").class_to_idx == {"0": 0, "1": 1, "2": 2}
        shutil.rmtree(data)


SPLITS_LISTED = (
    'DATA: {path} lists no splits (save_to_disk writes an object whose "splits" is a list '
    "of split names): save the set again with save_to_disk"
)


@pytest.mark.parametrize(
    ("file", "rewrite", "message"),
    [
        ("dataset_dict.json", lambda listed: json.dumps(listed["splits"]), SPLITS_LISTED),
        (
            "dataset_dict.json",
            lambda listed: json.dumps({"splits": " ".join(listed["splits"])}),
            SPLITS_LISTED,
        ),
        (
            "dataset_dict.json",
            lambda listed: json.dumps({"splits": [*listed["splits"], 5]}),
            SPLITS_LISTED,
        ),
        (
            "train/state.json",
            lambda state: json.dumps({**state, "_data_files": state["_data_files"] * 2}),
            "DATA: {path} lists 'data-00000-of-00001.arrow' twice: each file of the split is "
            "read once",
        ),
        (
            "train/state.json",
            lambda state: "[" * 100_000 + "]" * 100_000,  # past the JSON decoder's recursion
            "DATA: cannot read {path}: maximum recursion depth",
        ),
    ],
    ids=["a list", "splits a string", "a split a number", "a file twice", "nested deep"],
)
def test_malformed_save_to_disk_json_is_one_line_naming_it(
    tiny_dataset_dict, tmp_path, file, rewrite, message
):
    data = shutil.copytree(tiny_dataset_dict, tmp_path / "data")
    (data / file).write_text(rewrite(json.loads((data / file).read_text())))
    with pytest.raises(UserError) as raised:
        check.check_command(str(data), workers=0, max_image_pixels=10**8)
    assert str(raised.value).startswith(message.format(path=data / file))


@pytest.fixture
def bad_rows(tiny_data, tmp_path, monkeypatch):
    """tiny_data's val as one Parquet file with a null image (row 2), bytes that are no image
    (row 5) and an image stored by its path only (row 7), in train/ and val/ alike."""
    rows, classes = table_rows(tiny_data, "val")
    rows["image"][2] = None
    rows["image"][5] = {"bytes": b"not an image at all", "path": "x.png"}
    monkeypatch.chdir(tmp_path)  # datasets stores a path only where the file is
    shutil.copy(tiny_data / "val" / "bar" / "00000.png", "elsewhere.png")
    rows["image"][7] = {"bytes": None, "path": "elsewhere.png"}
    write_table_set(tmp_path / "data", with_features(rows, classes))
    return tmp_path / "data"


REASONS = {
    2: "no image (null in column 'image')",
    5: "not an image in a format TorchCodec or PIL reads",
    7: "no image bytes, only the path 'elsewhere.png': build the Image column from bytes, so "
    "that the table holds the images",
}


def test_each_bad_row_has_its_reason_and_stops_the_loader(bad_rows):
    table = source(bad_rows)
    names = table.names(("val",))
    assert [table.problem(name) for name in names] == [REASONS.get(i) for i in range(15)]
    dataset = table.split("val").dataset
    for row, reason in REASONS.items():
        with pytest.raises(UserError) as raised:
            dataset[row]
        assert str(raised.value).startswith(
            f"cannot read image {bad_rows / 'val' / 'part-0.parquet'}:{row}: {reason} ("
        )


def test_a_struct_of_bytes_alone_without_them_is_a_bad_row(tmp_path):
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    cells = [{"bytes": png.getvalue()}, {"bytes": None}]
    cells = pa.array(cells, pa.struct([("bytes", pa.binary())]))
    for split in ("train", "val"):
        (tmp_path / "data" / split).mkdir(parents=True)
        table = pa.table({"image": cells, "label": pa.array([0, 0])})
        pq.write_table(table, tmp_path / "data" / split / "part-0.parquet")
    table = source(tmp_path / "data")
    assert table.problem("val/part-0.parquet:0") is None
    assert table.problem("val/part-0.parquet:1") == (
        "no image bytes, nor a path: build the Image column from bytes, so that the table holds "
        "the images"
    )
    with pytest.raises(UserError, match=r"part-0.parquet:1: no image bytes, nor a path"):
        table.split("val").dataset[1]


def test_check_lists_the_bad_rows_and_skip_leaves_them_out(bad_rows, capsys):
    with pytest.raises(UserError, match=r"^6 of 30 images in .* \(3 of 15 train, 3 of 15 val\)"):
        check.check_command(str(bad_rows), workers=0, max_image_pixels=10**8, say=print)
    listed = capsys.readouterr().out.splitlines()
    assert listed[:3] == [f"{bad_rows}/train/part-0.parquet:{i}: {REASONS[i]}" for i in REASONS]
    leave_out = frozenset(
        f"{split}/part-0.parquet:{i}" for split in ("train", "val") for i in REASONS
    )
    config = Config(data=str(bad_rows), batch_size=4, workers=0, image_size=16)
    data = build_data(config, ONE, open_source(config), seed=0, leave_out=leave_out)
    assert data.num_val == 12 and data.facts["train"]["images"] == 12
    assert sum(len(target) for _, target in data.val_loader) == 12
    assert sum(len(target) for _, target in data.train_loader) == 12


def test_check_of_a_good_table_set_says_so(tiny_dataset_dict, capsys):
    check.check_command(str(tiny_dataset_dict), workers=0, max_image_pixels=10**8, say=print)
    assert (
        capsys.readouterr().out
        == f"all 39 images in {tiny_dataset_dict} decode (24 train, 15 val)\n"
    )


def test_other_column_names_are_given_by_flags(tiny_data, tmp_path):
    rows, _ = table_rows(tiny_data, "val")
    renamed = {"jpg": [r["bytes"] for r in rows["image"]], "cls": rows["label"]}
    write_table_set(tmp_path, datasets.Dataset.from_dict(renamed))
    with pytest.raises(
        UserError, match="no column 'image' \\(it has jpg, cls\\): name it with --image-column"
    ):
        source(tmp_path).names()
    split = source(tmp_path, image_column="jpg", label_column="cls").split("val")
    assert split.class_to_idx == {"0": 0, "1": 1, "2": 2}  # no ClassLabel: the integers
    folder = FolderSource(tiny_data).split("val")
    for i in range(len(folder.dataset)):
        (image, label), (expected, target) = split.dataset[i], folder.dataset[i]
        assert torch.equal(image, expected) and label == target
    with pytest.raises(UserError, match="must name two different columns"):
        Config(image_column="x", label_column="x")


def test_what_data_is_decides_its_source(tiny_data, tiny_parquet, tmp_path):
    assert isinstance(open_source(Config(data=str(tiny_data))), FolderSource)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(UserError, match=f"DATA: {tmp_path / 'nothing'} is neither an image folder"):
        open_source(Config(data=str(tmp_path / "nothing")))
    data = shutil.copytree(tiny_parquet, tmp_path / "data")
    shutil.rmtree(data / "val")
    with pytest.raises(UserError, match=f"DATA: {data / 'val'} holds no Parquet files"):
        source(data).split("val")
    (data / "train" / "part-1.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(
        UserError, match=f"^{data / 'train' / 'part-1.parquet'}: not a Parquet file"
    ):
        source(data).split("train")


def test_a_dataset_dict_without_a_val_split_is_refused(tiny_dataset_dict, tmp_path):
    data = shutil.copytree(tiny_dataset_dict, tmp_path / "data")
    (data / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(
        UserError, match=r"lists the splits \['train', 'test'\], none of them validation or val"
    ):
        source(data).split("val")


def test_without_pyarrow_the_extra_is_named(tiny_parquet, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=r"needs pyarrow: pip install 'ddptrain\[tables\]'"):
        open_source(Config(data=str(tiny_parquet)))


def test_loader_workers_read_the_same_batches(tiny_parquet):
    """Each worker opens the files itself (forked with none open): the same batches as -j 0."""
    batches = []
    for workers in (0, 2):
        config = Config(data=str(tiny_parquet), batch_size=8, workers=workers, image_size=16)
        data = build_data(config, ONE, open_source(config), seed=3)
        batches.append([*data.train_loader, *data.val_loader])
    for (images, targets), (expected, expected_targets) in zip(*batches, strict=True):
        assert torch.equal(images, expected) and torch.equal(targets, expected_targets)
