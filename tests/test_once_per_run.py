"""A session fixture's value made once per pytest run (tests/once_per_run.py)."""

from tests.once_per_run import once_per_run


def test_the_value_is_made_once_and_the_next_caller_reads_it_back(tmp_path_factory):
    folders = []

    def make(folder):
        folders.append(folder)
        (folder / "made").write_text("by the first caller")
        return {"steps": 3, "folder": folder}

    first = once_per_run(tmp_path_factory, "test-once-per-run", make)
    again = once_per_run(tmp_path_factory, "test-once-per-run", make)
    assert first == again and len(folders) == 1
    assert (again["folder"] / "made").read_text() == "by the first caller"
