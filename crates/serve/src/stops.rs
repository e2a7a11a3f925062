//! Stop strings matched on the text as it streams, across token boundaries: text that
//! could still be the start of a stop string is held back until it is not.

pub(crate) struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub(crate) fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops, held: String::new() }
    }

    /// Takes the next piece of text; returns the text that is safe to emit and whether a
    /// stop string ended the output (its text, and what follows, never emitted).
    pub(crate) fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // The longest tail of the held text that begins some stop string stays held.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(move |&k| s.is_char_boundary(k)).map(move |k| &s[..k]))
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// What is still held when the output ends without a stop string.
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (t, stopped) = m.push(p);
            out.push_str(&t);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_across_pieces_and_holds_back_only_what_may_match() {
        assert_eq!(run(&["STOP"], &["ab", "cS", "TO", "Pdef"]), ("abc".into(), true));
        assert_eq!(run(&["STOP"], &["abS", "Tx"]), ("abSTx".into(), false));
        assert_eq!(run(&["\n\n", "END"], &["one\n", "\ntwo"]), ("one".into(), true));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        // The earliest of two matches wins.
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
    }
}
