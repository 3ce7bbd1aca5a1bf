package tokenizer

import "unicode/utf8"

// The GPT-2 byte-level alphabet: every byte is shown as one printable rune so
// that BPE vocabularies can be stored as text. Printable Latin-1 bytes map to
// themselves; the other 68 bytes map to U+0100.. in byte order. This is
// bytes_to_unicode() of GPT-2 and of HF tokenizers' ByteLevel.
var (
	byteToRune [256]rune
	runeToByte = map[rune]byte{}
)

func init() {
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			byteToRune[b] = rune(b)
		} else {
			byteToRune[b] = rune(256 + n)
			n++
		}
		runeToByte[byteToRune[b]] = byte(b)
	}
}

// byteLevelDecode maps a vocabulary token written in the byte-level alphabet
// back to the raw bytes it stands for; ok is false if a rune is outside the
// alphabet (then the token is not a byte-level token).
func byteLevelDecode(tok string) (raw string, ok bool) {
	buf := make([]byte, 0, len(tok))
	for _, r := range tok {
		b, in := runeToByte[r]
		if !in {
			return "", false
		}
		buf = append(buf, b)
	}
	return string(buf), true
}

// byteLevelEncode writes raw bytes in the byte-level alphabet.
func byteLevelEncode(raw string) string {
	buf := make([]byte, 0, 2*len(raw))
	for i := 0; i < len(raw); i++ {
		buf = utf8.AppendRune(buf, byteToRune[raw[i]])
	}
	return string(buf)
}
