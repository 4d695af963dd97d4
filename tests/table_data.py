"""Table data sets made of image folders with Hugging Face `datasets` (the real library): the
conftest fixtures' and the tests' that need a table with a bad row."""


def table_rows(data, split: str) -> tuple[dict, list[str]]:
    """The images of an image folder's split, as columns in the folder's order: `image`
    (a datasets Image's {bytes, path}, the files' own bytes) and `label` (class index)."""
    from ddptrain.data.sources import FolderSource

    classes = sorted(p.name for p in (data / split).iterdir())
    names = FolderSource(data).names((split,))
    return {
        "image": [{"bytes": (data / n).read_bytes(), "path": n} for n in names],
        "label": [classes.index(n.split("/")[1]) for n in names],
    }, classes


def table_dataset(data, split: str):
    """A datasets.Dataset of the folder's split, with Image and ClassLabel features."""
    return with_features(*table_rows(data, split))


def with_features(rows: dict, classes: list[str]):
    """`rows` as a datasets.Dataset with Image and ClassLabel features."""
    import datasets

    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}
    )
    return datasets.Dataset.from_dict(rows, features=features)


def write_table_set(out, table):
    """A datasets.Dataset as one Parquet file in out/train/ and out/val/ alike."""
    for split in ("train", "val"):
        table.to_parquet(out / split / "part-0.parquet")
    return out
