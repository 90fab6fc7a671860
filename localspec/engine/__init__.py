"""The engine: the speculative loop and its events (``engine``), the drafter contract it calls
(``drafter``), its policy over one or more drafters (``choice``), the verifier as pure functions
(``verify``), adaptive draft length (``adaptive``) and statistics folded from events (``stats``).
It knows token ids, never models' files, chat templates or the UI."""
