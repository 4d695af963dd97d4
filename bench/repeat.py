"""A pytest plugin for the bench scripts that loop a test (bench/hang_loop.py): `-p bench.repeat
--repeat N` runs each collected test N times, as N items of their own (fixtures set up anew,
session ones once)."""


def pytest_addoption(parser) -> None:
    parser.addoption("--repeat", type=int, default=1, help="run each test this many times")


def pytest_generate_tests(metafunc) -> None:
    count = metafunc.config.getoption("repeat")
    if count > 1:
        metafunc.fixturenames.append("_repeat")
        metafunc.parametrize("_repeat", range(count), ids=lambda i: f"run{i}")
