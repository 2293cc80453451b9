"""What every stage uses: where work runs, what a long stage prints, perplexity.

- ``devices``: what ``"auto"`` means for torch and for faiss, and the checks of a device setting;
- ``progress``: progress bars or plain log lines, and the one line per stage;
- ``metrics``: perplexity (the one definition), bits per token, token NLL;
- ``quiet``: Lightning's promotional or untrue messages, silenced without importing it;
- ``environment``: the device and package versions a run records beside its results.
"""
