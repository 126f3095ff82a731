// How the page writes quantities; a file of its own so that node can check it without a page
// (tests/test_page_format.py).
"use strict";

// decimal units, as "kB" and "MB" are defined: 1 kB = 1000 bytes
const BYTE_UNITS = ["kB", "MB", "GB"];

function formatBytes(bytes) {
  // bytes below 1 kB exactly ("28 B"); above, in the largest unit that keeps the number under 1000,
  // one decimal below 10 ("1.5 kB"), whole above ("28 kB", "340 MB")
  if (bytes < 1000) return `${bytes} B`;
  let value = bytes;
  for (const [i, unit] of BYTE_UNITS.entries()) {
    value /= 1000;
    const text = value < 9.95 ? value.toFixed(1) : String(Math.round(value));
    // 999 600 bytes round to "1000 kB": written in the next unit instead ("1.0 MB")
    if (Number(text) < 1000 || i === BYTE_UNITS.length - 1) return `${text} ${unit}`;
  }
}

if (typeof module !== "undefined") module.exports = { formatBytes };
