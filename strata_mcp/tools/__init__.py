"""One module per tool; ALL_TOOLS is the order tools/list shows them in."""

from strata_mcp.tools import chat, check_pc, choose_model, install, start, status, stop

ALL_TOOLS = [check_pc.SPEC, choose_model.SPEC, install.SPEC, start.SPEC, chat.SPEC, status.SPEC, stop.SPEC]
