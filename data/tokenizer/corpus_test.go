package tokenizer

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"unicode"
)

// handCases are written to hit each alternative of the pre-tokenizer
// regexes, the added-token matcher and the normalizer.
var handCases = []string{
	"",
	" ",
	"a",
	"Hello world",
	"Hello world  \n\n 12345 <|im_end|>x",
	"don't I'm we'll you're they've he'd it's",
	"DON'T I'M WE'LL YOU'RE THEY'VE HE'D IT'S",
	"'s 's' ''s x's 'S 'Re 'rE 'ſ 'ſa 'ſt",
	"x'ſa", "I'ſ", "a'ſt", "a'ſſ", "(\"'ſa\")", "a'S a'T a'RE a'Ve a'M a'LL a'D a'Ll a'lL a'x", "a'll've",
	"'", "''", "'''a", "a'", "'\n", "' s",
	"1", "12", "123", "1234", "12345678901", "3.14159", "1,000,000", "٣٤٥ ১২৩ ⅷ ²³ ①②③",
	"x1y22z333", " 1", "  1", "a 1 b 22",
	"\t", "\t\t", "\tfoo", " \tfoo", "\t\tfoo", "\n", "\n\n", "\r\n", "\r\n\r\n", "a\r\nb", "a\rb",
	"  a", "   a", "a  ", "a   b", "a \n b", "a\n \nb", " \n ", "\n \n  ", "\u00a0a", "a\u00a0\u00a0b",
	"\u3000\u3000漢字", "x\u2028y\u2029z", "a\u0085b", "a \u0085 b", "\u0085\u0085", "a\ufeffb", " \ufeffc",
	"\u000b\u000c\u001c\u001d\u001e\u001f x", "\u200b\u200c\u200d", "a\u180eb", "\u205f\u202f\u1680",
	"!!!", " !!!", "!!!\n", "!!!\r\n\n", " ?!\n\nx", "...\n", "a.b", "(x)", "[[]]", "{\"k\": [1, 2]}",
	"func main() {\n\tfmt.Println(\"hi\")\n}\n",
	"def f(x):\n    return x ** 2  # square\n\n\nclass A:\n    pass\n",
	"#include <stdio.h>\nint main(void) { return 0; }\r\n",
	"    indented\n        more\n\tand tabs\n",
	"中文分词测试，这是一个句子。", "日本語のテキストです。カタカナ、ひらがな。", "한국어 문장입니다.",
	"مرحبا بالعالم", "Привет, мир! Ёжик", "Ελληνικά κείμενα", "שלום עולם", "हिन्दी पाठ", "ไทยภาษา",
	"👋🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️ 🧑🏿‍🚀", "a😀b", "😀😀😀", " 😀", "x\U0001F600\U0001F601",
	"e\u0301", "cafe\u0301 na\u0308ive", "\u1100\u1161\u11a8", "Å Å", "\u0041\u030a\u0301", "é\u0301",
	"a\u0301\u0302\u0303\u0304", "\u0301start", " \u0301", "ﬁ ﬀ ſ K Å",
	"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
	"x<|endoftext|>y", "<|im_end|><|im_end|>", "<|im_end", "<|im_end|", "|im_end|>", "<<|im_end|>>",
	"<think>\nhmm\n</think>\n\nanswer", "<tool_call>{}</tool_call>",
	"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
	"<|reserved_special_token_0|><|reserved_special_token_250|>", "<|reserved_special_token_2",
	"a<|begin_of_text|>", "e\u0301<|im_end|>\u0301",
	strings.Repeat("a", 3000),
	strings.Repeat("ab ", 700),
	strings.Repeat("9", 2000),
	strings.Repeat(" ", 1500) + "x",
	strings.Repeat("\n", 600),
	strings.Repeat("=-", 800),
	strings.Repeat("😀", 300),
	strings.Repeat("漢", 1000),
	strings.Repeat("a\u0301", 300),
}

// corpus returns the exactness corpus: the hand cases, chunks of real code
// and prose, and generated strings (deterministic seeds).
func corpus() []string {
	out := append([]string(nil), handCases...)
	for _, f := range []string{"bench_code.go.txt", "bench_prose.txt"} {
		b, err := os.ReadFile(filepath.Join("testdata", f))
		if err != nil {
			continue // the benchmark files are committed; a missing one fails TestCorpusFiles
		}
		s := string(b)
		for i := 0; i+1500 <= len(s) && i < 60000; i += 1500 {
			out = append(out, s[i:i+1500])
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 1500; i++ {
		out = append(out, mixedString(r, 1+r.IntN(40)))
	}
	for i := 0; i < 400; i++ {
		out = append(out, randomUnicode(r, 1+r.IntN(30)))
	}
	return out
}

// fragments are the pieces mixedString glues together: each class of rune
// the regexes distinguish, in the combinations that make alternatives
// compete (space before letters/digits/punctuation, runs of white space with
// and without newlines, contractions, added tokens cut short).
var fragments = []string{
	" ", "  ", "   ", "\t", "\n", "\r", "\r\n", "\n\n", " \n", "\u00a0", "\u3000", "\u0085", "\u2028", "\v", "\f",
	"a", "Z", "word", "Hello", "ÉCOLE", "naïve", "straße", "ſ", "漢字", "かな", "한", "ж", "λ", "ب", "ה", "ก", "क्ष",
	"0", "7", "42", "123", "2024", "٣", "²", "Ⅻ", "½", "१२",
	"'", "'s", "'t", "x'ſ", "a'S", "b'LL", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'Ve",
	".", ",", "!", "?", "...", "-", "_", "(", ")", "{", "}", "\"", "#", "@", "$", "%", "^", "&", "*", "+", "=", "/", "\\", "|", "~", "`", "<", ">",
	"😀", "👨‍👩‍👧", "🏳️‍🌈", "👍🏽", "\u200d", "\ufe0f", "\u0301", "\u0308", "e\u0301", "\ufeff", "\u200b",
	"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|begin_of_text|>", "<|eot_id|>", "<|im_", "|>", "<|",
	"func", "return", "if err != nil {", "}\n", "\t\treturn", "x := 1", "// comment", "/* c */", "==", "!=", "&&", "||", "->", "=>",
}

func mixedString(r *rand.Rand, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		b.WriteString(fragments[r.IntN(len(fragments))])
	}
	return b.String()
}

// randomUnicode draws code points assigned in the Unicode version of Go's
// tables, half of them from the BMP's busy low planes.
func randomUnicode(r *rand.Rand, n int) string {
	var b strings.Builder
	for b.Len() < 4*n {
		var c rune
		switch r.IntN(4) {
		case 0:
			c = rune(r.IntN(0x80))
		case 1:
			c = rune(r.IntN(0x3000))
		case 2:
			c = rune(r.IntN(0x10000))
		default:
			c = rune(r.IntN(0x30000))
		}
		if assigned(c) {
			b.WriteRune(c)
		}
	}
	return b.String()
}

func assigned(c rune) bool {
	if c >= 0xD800 && c <= 0xDFFF {
		return false
	}
	return unicode.In(c, unicode.L, unicode.M, unicode.N, unicode.P, unicode.S, unicode.Z, unicode.Cc, unicode.Cf)
}
