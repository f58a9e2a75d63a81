//! How sampler and schedule names are matched: the one spelling rule both
//! follow, kept in a leaf so the sampler and schedule modules need not
//! import each other.

/// Normalises a name: lowercase, with `-`, `_` and spaces dropped.
pub(crate) fn normalize(s: &str) -> String {
    s.chars()
        .filter(|c| !matches!(c, '-' | '_' | ' '))
        .flat_map(char::to_lowercase)
        .collect()
}

/// Names, comma-separated (for error lines and help texts).
pub(crate) fn joined<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names.into_iter().collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn normalize_drops_separators_and_case() {
        assert_eq!(super::normalize("DPM++ 2M_sde-Karras"), "dpm++2msdekarras");
        assert_eq!(super::joined(["a", "b"]), "a, b");
    }
}
