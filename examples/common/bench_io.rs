//! Command-line flags and JSON row fields of the candle benchmark examples.

/// The value after `flag` in `args`.
pub fn arg_after(args: &[String], flag: &str) -> Option<String> {
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1).cloned())
}

/// The value of `key` in a flat one-line JSON object (strings without their quotes; "" if absent).
pub fn field<'a>(json: &'a str, key: &str) -> &'a str {
    let pat = format!("\"{key}\": ");
    let at = json.find(&pat).map(|i| i + pat.len()).unwrap_or(json.len());
    let rest = &json[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim_matches('"')
}
