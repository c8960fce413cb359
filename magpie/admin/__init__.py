"""The operator's bulk actions shared by the CLI and the web console (:mod:`.operations`) and the
route export (:mod:`.export`)."""
