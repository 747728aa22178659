

def test_git_commit_says_when_the_checkout_has_uncommitted_changes(tmp_path) -> None:  # noqa: ANN001
    """Regression: a benchmark run on uncommitted changes was stamped with the clean commit."""
    import subprocess

    from tetri_server.bench.report import git_commit

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("commit", "-qm", "one")
    clean = git_commit(tmp_path)
    assert clean != "unknown" and not clean.endswith("-dirty")
    (tmp_path / "f").write_text("b")
    assert git_commit(tmp_path) == clean + "-dirty"


def test_a_cdf_counts_the_failed_requests_in_its_fractions() -> None:
    """Regression (review of session 62): the TTFT / JCT CDFs divided by the requests that
    succeeded, so a mode that failed half its requests still reached 1.0."""
    from tetri_server.bench.report import cdf_points

    xs, ys = cdf_points([3.0, 1.0], 4)
    assert xs == [1.0, 3.0] and ys == [0.25, 0.5]
    assert cdf_points([], 0) == ([], [])
