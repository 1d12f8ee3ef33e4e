"""What people read about a plan: the text summary (``text``), the HTML report (``html``) and why a
decision was made (``explain``). Reads ``autopar.ir`` only."""
