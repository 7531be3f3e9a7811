import logging
import warnings

from pipeline.quiet import silenced


def test_silenced_hides_warnings_and_info_then_restores_levels(caplog):
    logger = logging.getLogger("some.library")
    logger.setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO, logger="some.library"):
        warnings.simplefilter("always")
        with silenced("some.library"):
            logger.warning("advice nobody asked for")
            warnings.warn("noise", UserWarning, stacklevel=1)
            logger.error("a real error")
        logger.info("after")
    assert [r.getMessage() for r in caplog.records] == ["a real error", "after"]
    assert seen == []
    assert logger.level == logging.INFO
