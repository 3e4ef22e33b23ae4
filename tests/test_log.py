from gradsync.log import configure_logging
from gradsync.metrics.sinks import ProgressDisplay


def test_logs_are_rank_prefixed_and_rank_zero_speaks_for_summaries(capfd):
    logger = configure_logging(0)
    logger.info("summary line")
    logger = configure_logging(1)
    logger.info("not from rank 1")
    logger.warning("a warning")
    err = capfd.readouterr().err
    assert "[gradsync rank 0] summary line" in err
    assert "not from rank 1" not in err
    assert "[gradsync rank 1] a warning" in err


def test_without_a_terminal_progress_is_a_log_line_per_gather(capfd):
    display = ProgressDisplay(configure_logging(0), enabled=True)
    display.set_total(40)
    display.report({"step": 20, "epoch": 1, "loss": 0.25, "samples_per_s": 1234.0, "exposed_comm_share": 0.12, "skipped": None})
    display.close()
    assert "[gradsync rank 0] step 20/40 | epoch 1 | loss 0.2500 | 1234 samples/s | exposed comm 12%" in capfd.readouterr().err
