"""One module per tool; ALL_TOOLS is the order tools/list shows them in."""

from strata_mcp.tools import (
    benchmark, chat, check_pc, choose_model, connect_info, install, logs, start, status, stop,
)

ALL_TOOLS = [
    check_pc.SPEC, choose_model.SPEC, install.SPEC, start.SPEC, chat.SPEC, status.SPEC, stop.SPEC,
    connect_info.SPEC, logs.SPEC, benchmark.SPEC,
]
