package chattmpl

import (
	"fmt"
	"strings"
)

// ---- AST ----

// Statements.
type (
	node any

	textNode  struct{ text string }
	printNode struct {
		x    expr
		line int
	}
	ifNode struct {
		conds  []expr
		bodies [][]node
		els    []node
	}
	forNode struct {
		targets []string // one name, or several for tuple unpacking
		unpack  bool
		iter    expr
		cond    expr // optional "for x in xs if cond"
		body    []node
		els     []node
		line    int
	}
	setNode struct {
		targets []string
		unpack  bool
		nsVar   string // {% set ns.attr = v %}: nsVar="ns", targets=["attr"]
		x       expr
		line    int
	}
	setBlockNode struct {
		name    string
		filters []*filterExpr // applied to the captured body, innermost first
		body    []node
		line    int
	}
	macroNode struct {
		name     string
		params   []string
		defaults []expr // nil entry: required parameter
		body     []node
		line     int
	}
	loopCtlNode struct {
		brk  bool
		line int
	}
	generationNode  struct{ body []node }
	filterBlockNode struct {
		filters []*filterExpr
		body    []node
	}
	withNode struct {
		names []string
		xs    []expr
		body  []node
	}
)

// Expressions. Every node records its line for error messages.
type (
	expr any

	constExpr struct {
		v    any
		line int
	}
	nameExpr struct {
		name string
		line int
	}
	getattrExpr struct {
		obj  expr
		attr string
		line int
	}
	getitemExpr struct {
		obj, key expr
		line     int
	}
	sliceExpr struct {
		obj               expr
		start, stop, step expr
		line              int
	}
	kwarg struct {
		name string
		x    expr
	}
	callExpr struct {
		fn     expr
		args   []expr
		kwargs []kwarg
		line   int
	}
	filterExpr struct {
		obj    expr // nil in {% filter %} blocks and set-block filters
		name   string
		fn     filterFunc
		args   []expr
		kwargs []kwarg
		line   int
	}
	testExpr struct {
		obj    expr
		name   string
		fn     testFunc
		args   []expr
		kwargs []kwarg
		line   int
	}
	binExpr struct {
		op   string // + - * / // % ** ~ and or
		l, r expr
		line int
	}
	unaryExpr struct {
		op   string // - + not
		x    expr
		line int
	}
	compareExpr struct {
		first expr
		ops   []string // == != < <= > >= in notin
		rest  []expr
		line  int
	}
	condExpr struct {
		cond, a, b expr // b may be nil: undefined
		line       int
	}
	listExpr struct {
		items []expr
		line  int
	}
	tupleExpr struct {
		items []expr
		line  int
	}
	dictExpr struct {
		keys, vals []expr
		line       int
	}
)

// ---- parser ----

type parser struct {
	toks []token
	pos  int
}

func (p *parser) cur() token  { return p.toks[p.pos] }
func (p *parser) next() token { t := p.toks[p.pos]; p.pos++; return t }
func (p *parser) peek(n int) token {
	if p.pos+n < len(p.toks) {
		return p.toks[p.pos+n]
	}
	return p.toks[len(p.toks)-1]
}

func (p *parser) errf(line int, format string, args ...any) error {
	return &Error{Kind: ErrSyntax, Line: line, Msg: fmt.Sprintf(format, args...)}
}

func (p *parser) unsupported(line int, format string, args ...any) error {
	return &Error{Kind: ErrUnsupported, Line: line, Msg: fmt.Sprintf(format, args...)}
}

func (p *parser) isOp(op string) bool {
	t := p.cur()
	return t.kind == tOp && t.val == op
}

func (p *parser) isName(name string) bool {
	t := p.cur()
	return t.kind == tName && t.val == name
}

func (p *parser) expectOp(op string) error {
	t := p.cur()
	if t.kind != tOp || t.val != op {
		return p.errf(t.line, "expected '%s', got %s", op, t)
	}
	p.pos++
	return nil
}

func (p *parser) expectName() (string, error) {
	t := p.cur()
	if t.kind != tName {
		return "", p.errf(t.line, "expected a name, got %s", t)
	}
	p.pos++
	return t.val, nil
}

func (p *parser) expectKeyword(kw string) error {
	if !p.isName(kw) {
		return p.errf(p.cur().line, "expected '%s', got %s", kw, p.cur())
	}
	p.pos++
	return nil
}

func (p *parser) expectBlockEnd() error {
	t := p.cur()
	if t.kind != tBlockEnd {
		return p.errf(t.line, "expected end of statement '%%}', got %s", t)
	}
	p.pos++
	return nil
}

// parseTemplate parses the whole token stream.
func parseTemplate(toks []token) ([]node, error) {
	p := &parser{toks: toks}
	body, end, err := p.parseBody(nil)
	if err != nil {
		return nil, err
	}
	if end != "" {
		return nil, p.errf(p.cur().line, "unexpected '%s'", end)
	}
	return body, nil
}

// endTags that close blocks; seeing one where it is not expected is an error.
var closingTags = map[string]bool{
	"endfor": true, "endif": true, "elif": true, "else": true, "endmacro": true,
	"endset": true, "endfilter": true, "endwith": true, "endgeneration": true,
	"endcall": true, "endblock": true, "endraw": true,
}

// parseBody parses statements until one of ends (a block tag name) or EOF.
// It returns the end tag found, leaving the parser just after its name.
func (p *parser) parseBody(ends []string) ([]node, string, error) {
	var out []node
	for {
		t := p.cur()
		switch t.kind {
		case tEOF:
			if len(ends) > 0 {
				return nil, "", p.errf(t.line, "unexpected end of template: expected {%% %s %%}", strings.Join(ends, " %} or {% "))
			}
			return out, "", nil
		case tText:
			p.pos++
			out = append(out, &textNode{text: t.val})
		case tVarBegin:
			p.pos++
			x, err := p.parseTuple(false)
			if err != nil {
				return nil, "", err
			}
			if p.cur().kind != tVarEnd {
				return nil, "", p.errf(p.cur().line, "expected end of print statement '}}', got %s", p.cur())
			}
			p.pos++
			out = append(out, &printNode{x: x, line: t.line})
		case tBlockBegin:
			nt := p.peek(1)
			if nt.kind != tName {
				return nil, "", p.errf(nt.line, "expected a statement name after '{%%', got %s", nt)
			}
			for _, e := range ends {
				if nt.val == e {
					p.pos += 2
					return out, e, nil
				}
			}
			if closingTags[nt.val] {
				if len(ends) == 0 {
					return nil, "", p.errf(nt.line, "unexpected {%% %s %%}: no open block to close", nt.val)
				}
				return nil, "", p.errf(nt.line, "unexpected {%% %s %%}: expected {%% %s %%}", nt.val, strings.Join(ends, " %} or {% "))
			}
			p.pos += 2
			n, err := p.parseStatement(nt)
			if err != nil {
				return nil, "", err
			}
			out = append(out, n)
		default:
			return nil, "", p.errf(t.line, "unexpected %s", t)
		}
	}
}

func (p *parser) parseStatement(kw token) (node, error) {
	switch kw.val {
	case "if":
		return p.parseIf()
	case "for":
		return p.parseFor(kw.line)
	case "set":
		return p.parseSet(kw.line)
	case "macro":
		return p.parseMacro(kw.line)
	case "break", "continue":
		if err := p.expectBlockEnd(); err != nil {
			return nil, err
		}
		return &loopCtlNode{brk: kw.val == "break", line: kw.line}, nil
	case "generation":
		if err := p.expectBlockEnd(); err != nil {
			return nil, err
		}
		body, _, err := p.parseBody([]string{"endgeneration"})
		if err != nil {
			return nil, err
		}
		return &generationNode{body: body}, p.expectBlockEnd()
	case "filter":
		var fs []*filterExpr
		for {
			f, err := p.parseFilter(nil)
			if err != nil {
				return nil, err
			}
			fs = append(fs, f)
			if !p.isOp("|") {
				break
			}
			p.pos++
		}
		if err := p.expectBlockEnd(); err != nil {
			return nil, err
		}
		body, _, err := p.parseBody([]string{"endfilter"})
		if err != nil {
			return nil, err
		}
		return &filterBlockNode{filters: fs, body: body}, p.expectBlockEnd()
	case "with":
		w := &withNode{}
		for p.cur().kind != tBlockEnd {
			if len(w.names) > 0 {
				if err := p.expectOp(","); err != nil {
					return nil, err
				}
			}
			name, err := p.expectName()
			if err != nil {
				return nil, err
			}
			if err := p.expectOp("="); err != nil {
				return nil, err
			}
			x, err := p.parseExpr(true)
			if err != nil {
				return nil, err
			}
			w.names = append(w.names, name)
			w.xs = append(w.xs, x)
		}
		p.pos++
		body, _, err := p.parseBody([]string{"endwith"})
		if err != nil {
			return nil, err
		}
		w.body = body
		return w, p.expectBlockEnd()
	case "include", "extends", "import", "from", "block":
		return nil, p.unsupported(kw.line, "{%% %s %%} is not supported: a chat template must be a single self-contained template", kw.val)
	case "call":
		return nil, p.unsupported(kw.line, "{%% call %%} blocks are not supported by chattmpl; call the macro directly with {{ name(...) }}")
	case "do":
		return nil, p.errf(kw.line, "unknown tag 'do': transformers does not enable the jinja2.ext.do extension")
	case "autoescape":
		return nil, p.unsupported(kw.line, "{%% autoescape %%} is not supported (chat templates render without autoescaping)")
	}
	return nil, p.errf(kw.line, "unknown tag '%s'", kw.val)
}

func (p *parser) parseIf() (node, error) {
	n := &ifNode{}
	for {
		cond, err := p.parseTuple(false)
		if err != nil {
			return nil, err
		}
		if err := p.expectBlockEnd(); err != nil {
			return nil, err
		}
		body, end, err := p.parseBody([]string{"elif", "else", "endif"})
		if err != nil {
			return nil, err
		}
		n.conds = append(n.conds, cond)
		n.bodies = append(n.bodies, body)
		switch end {
		case "elif":
			continue
		case "else":
			if err := p.expectBlockEnd(); err != nil {
				return nil, err
			}
			els, _, err := p.parseBody([]string{"endif"})
			if err != nil {
				return nil, err
			}
			n.els = els
		}
		return n, p.expectBlockEnd()
	}
}

func (p *parser) parseFor(line int) (node, error) {
	n := &forNode{line: line}
	for {
		name, err := p.expectName()
		if err != nil {
			return nil, err
		}
		n.targets = append(n.targets, name)
		if !p.isOp(",") {
			break
		}
		n.unpack = true
		p.pos++
		if p.isName("in") {
			break
		}
	}
	if err := p.expectKeyword("in"); err != nil {
		return nil, err
	}
	iter, err := p.parseTupleNoCond()
	if err != nil {
		return nil, err
	}
	n.iter = iter
	if p.isName("if") {
		p.pos++
		if n.cond, err = p.parseExpr(true); err != nil {
			return nil, err
		}
	}
	if p.isName("recursive") {
		return nil, p.unsupported(p.cur().line, "recursive for loops are not supported by chattmpl")
	}
	if err := p.expectBlockEnd(); err != nil {
		return nil, err
	}
	body, end, err := p.parseBody([]string{"else", "endfor"})
	if err != nil {
		return nil, err
	}
	n.body = body
	if end == "else" {
		if err := p.expectBlockEnd(); err != nil {
			return nil, err
		}
		if n.els, _, err = p.parseBody([]string{"endfor"}); err != nil {
			return nil, err
		}
	}
	return n, p.expectBlockEnd()
}

func (p *parser) parseSet(line int) (node, error) {
	first, err := p.expectName()
	if err != nil {
		return nil, err
	}
	if p.isOp(".") {
		p.pos++
		attr, err := p.expectName()
		if err != nil {
			return nil, err
		}
		if err := p.expectOp("="); err != nil {
			return nil, err
		}
		x, err := p.parseTuple(false)
		if err != nil {
			return nil, err
		}
		return &setNode{nsVar: first, targets: []string{attr}, x: x, line: line}, p.expectBlockEnd()
	}
	n := &setNode{targets: []string{first}, line: line}
	for p.isOp(",") {
		p.pos++
		n.unpack = true
		if p.isOp("=") {
			break
		}
		name, err := p.expectName()
		if err != nil {
			return nil, err
		}
		n.targets = append(n.targets, name)
	}
	if p.isOp("=") {
		p.pos++
		if n.x, err = p.parseTuple(false); err != nil {
			return nil, err
		}
		return n, p.expectBlockEnd()
	}
	if n.unpack {
		return nil, p.errf(line, "block {%% set %%} takes a single name")
	}
	// Block set: {% set name | filters %}...{% endset %}
	b := &setBlockNode{name: first, line: line}
	for p.isOp("|") {
		p.pos++
		f, err := p.parseFilter(nil)
		if err != nil {
			return nil, err
		}
		b.filters = append(b.filters, f)
	}
	if err := p.expectBlockEnd(); err != nil {
		return nil, err
	}
	if b.body, _, err = p.parseBody([]string{"endset"}); err != nil {
		return nil, err
	}
	return b, p.expectBlockEnd()
}

func (p *parser) parseMacro(line int) (node, error) {
	name, err := p.expectName()
	if err != nil {
		return nil, err
	}
	m := &macroNode{name: name, line: line}
	if err := p.expectOp("("); err != nil {
		return nil, err
	}
	for !p.isOp(")") {
		if len(m.params) > 0 {
			if err := p.expectOp(","); err != nil {
				return nil, err
			}
			if p.isOp(")") {
				break
			}
		}
		pn, err := p.expectName()
		if err != nil {
			return nil, err
		}
		var def expr
		if p.isOp("=") {
			p.pos++
			if def, err = p.parseExpr(true); err != nil {
				return nil, err
			}
		} else if len(m.defaults) > 0 && m.defaults[len(m.defaults)-1] != nil {
			return nil, p.errf(line, "macro %s: parameter %s without a default follows one with a default", name, pn)
		}
		m.params = append(m.params, pn)
		m.defaults = append(m.defaults, def)
	}
	p.pos++
	if err := p.expectBlockEnd(); err != nil {
		return nil, err
	}
	if m.body, _, err = p.parseBody([]string{"endmacro"}); err != nil {
		return nil, err
	}
	if p.cur().kind == tName && p.cur().val == name {
		p.pos++ // {% endmacro name %}
	}
	return m, p.expectBlockEnd()
}

// ---- expressions (precedence as in jinja2/parser.py) ----

// parseTuple parses "a" or "a, b, ..." (a tuple without parentheses).
func (p *parser) parseTuple(explicitParens bool) (expr, error) {
	line := p.cur().line
	var items []expr
	isTuple := false
	for {
		if len(items) > 0 {
			if !p.isOp(",") {
				break
			}
			p.pos++
			isTuple = true
		}
		if p.tupleEnd(explicitParens) {
			break
		}
		x, err := p.parseExpr(true)
		if err != nil {
			return nil, err
		}
		items = append(items, x)
	}
	if !isTuple {
		if len(items) == 0 {
			if explicitParens {
				return &tupleExpr{line: line}, nil
			}
			return nil, p.errf(line, "expected an expression, got %s", p.cur())
		}
		return items[0], nil
	}
	return &tupleExpr{items: items, line: line}, nil
}

// parseTupleNoCond is parseTuple for "for x in <iter> if cond": the iterable
// may not contain a bare conditional expression.
func (p *parser) parseTupleNoCond() (expr, error) {
	line := p.cur().line
	var items []expr
	for {
		x, err := p.parseExpr(false)
		if err != nil {
			return nil, err
		}
		items = append(items, x)
		if !p.isOp(",") {
			break
		}
		p.pos++
		if p.tupleEnd(false) || p.isName("if") {
			break
		}
	}
	if len(items) == 1 {
		return items[0], nil
	}
	return &tupleExpr{items: items, line: line}, nil
}

func (p *parser) tupleEnd(explicitParens bool) bool {
	t := p.cur()
	switch t.kind {
	case tVarEnd, tBlockEnd, tEOF:
		return true
	case tOp:
		return t.val == ")" || t.val == "=" && !explicitParens
	}
	return false
}

func (p *parser) parseExpr(withCond bool) (expr, error) {
	x, err := p.parseOr()
	if err != nil || !withCond {
		return x, err
	}
	for p.isName("if") {
		line := p.cur().line
		p.pos++
		cond, err := p.parseOr()
		if err != nil {
			return nil, err
		}
		c := &condExpr{cond: cond, a: x, line: line}
		if p.isName("else") {
			p.pos++
			if c.b, err = p.parseExpr(true); err != nil {
				return nil, err
			}
		}
		x = c
	}
	return x, nil
}

func (p *parser) parseOr() (expr, error) {
	x, err := p.parseAnd()
	for err == nil && p.isName("or") {
		line := p.next().line
		var r expr
		if r, err = p.parseAnd(); err == nil {
			x = &binExpr{op: "or", l: x, r: r, line: line}
		}
	}
	return x, err
}

func (p *parser) parseAnd() (expr, error) {
	x, err := p.parseNot()
	for err == nil && p.isName("and") {
		line := p.next().line
		var r expr
		if r, err = p.parseNot(); err == nil {
			x = &binExpr{op: "and", l: x, r: r, line: line}
		}
	}
	return x, err
}

func (p *parser) parseNot() (expr, error) {
	if p.isName("not") {
		line := p.next().line
		x, err := p.parseNot()
		if err != nil {
			return nil, err
		}
		return &unaryExpr{op: "not", x: x, line: line}, nil
	}
	return p.parseCompare()
}

func (p *parser) parseCompare() (expr, error) {
	line := p.cur().line
	x, err := p.parseMath1()
	if err != nil {
		return nil, err
	}
	c := &compareExpr{first: x, line: line}
	for {
		t := p.cur()
		var op string
		switch {
		case t.kind == tOp && (t.val == "==" || t.val == "!=" || t.val == "<" || t.val == "<=" || t.val == ">" || t.val == ">="):
			op = t.val
			p.pos++
		case t.kind == tName && t.val == "in":
			op = "in"
			p.pos++
		case t.kind == tName && t.val == "not" && p.peek(1).kind == tName && p.peek(1).val == "in":
			op = "notin"
			p.pos += 2
		}
		if op == "" {
			break
		}
		r, err := p.parseMath1()
		if err != nil {
			return nil, err
		}
		c.ops = append(c.ops, op)
		c.rest = append(c.rest, r)
	}
	if len(c.ops) == 0 {
		return x, nil
	}
	return c, nil
}

func (p *parser) parseBinary(ops []string, next func() (expr, error)) (expr, error) {
	x, err := next()
	if err != nil {
		return nil, err
	}
	for {
		t := p.cur()
		match := ""
		if t.kind == tOp {
			for _, o := range ops {
				if t.val == o {
					match = o
				}
			}
		}
		if match == "" {
			return x, nil
		}
		p.pos++
		r, err := next()
		if err != nil {
			return nil, err
		}
		x = &binExpr{op: match, l: x, r: r, line: t.line}
	}
}

func (p *parser) parseMath1() (expr, error) {
	return p.parseBinary([]string{"+", "-"}, p.parseConcat)
}

func (p *parser) parseConcat() (expr, error) {
	return p.parseBinary([]string{"~"}, p.parseMath2)
}

func (p *parser) parseMath2() (expr, error) {
	return p.parseBinary([]string{"*", "/", "//", "%"}, p.parsePow)
}

func (p *parser) parsePow() (expr, error) {
	return p.parseBinary([]string{"**"}, func() (expr, error) { return p.parseUnary(true) })
}

func (p *parser) parseUnary(withFilter bool) (expr, error) {
	t := p.cur()
	var x expr
	var err error
	if t.kind == tOp && (t.val == "-" || t.val == "+") {
		p.pos++
		inner, err := p.parseUnary(false)
		if err != nil {
			return nil, err
		}
		x = &unaryExpr{op: t.val, x: inner, line: t.line}
	} else if x, err = p.parsePrimary(); err != nil {
		return nil, err
	}
	if x, err = p.parsePostfix(x); err != nil {
		return nil, err
	}
	if withFilter {
		return p.parseFilterExpr(x)
	}
	return x, nil
}

func (p *parser) parsePrimary() (expr, error) {
	t := p.next()
	switch t.kind {
	case tName:
		switch t.val {
		case "true", "True":
			return &constExpr{v: true, line: t.line}, nil
		case "false", "False":
			return &constExpr{v: false, line: t.line}, nil
		case "none", "None":
			return &constExpr{v: nil, line: t.line}, nil
		}
		return &nameExpr{name: t.val, line: t.line}, nil
	case tString:
		s := t.val
		for p.cur().kind == tString { // adjacent literals concatenate
			s += p.next().val
		}
		return &constExpr{v: s, line: t.line}, nil
	case tInt, tFloat:
		return &constExpr{v: t.num, line: t.line}, nil
	case tOp:
		switch t.val {
		case "(":
			x, err := p.parseTuple(true)
			if err != nil {
				return nil, err
			}
			return x, p.expectOp(")")
		case "[":
			l := &listExpr{line: t.line}
			for !p.isOp("]") {
				if len(l.items) > 0 {
					if err := p.expectOp(","); err != nil {
						return nil, err
					}
					if p.isOp("]") {
						break
					}
				}
				x, err := p.parseExpr(true)
				if err != nil {
					return nil, err
				}
				l.items = append(l.items, x)
			}
			p.pos++
			return l, nil
		case "{":
			d := &dictExpr{line: t.line}
			for !p.isOp("}") {
				if len(d.keys) > 0 {
					if err := p.expectOp(","); err != nil {
						return nil, err
					}
					if p.isOp("}") {
						break
					}
				}
				k, err := p.parseExpr(true)
				if err != nil {
					return nil, err
				}
				if err := p.expectOp(":"); err != nil {
					return nil, err
				}
				v, err := p.parseExpr(true)
				if err != nil {
					return nil, err
				}
				d.keys = append(d.keys, k)
				d.vals = append(d.vals, v)
			}
			p.pos++
			return d, nil
		}
	}
	return nil, p.errf(t.line, "unexpected %s in expression", t)
}

func (p *parser) parsePostfix(x expr) (expr, error) {
	for {
		t := p.cur()
		if t.kind != tOp {
			return x, nil
		}
		switch t.val {
		case ".":
			p.pos++
			a := p.next()
			switch a.kind {
			case tName:
				x = &getattrExpr{obj: x, attr: a.val, line: a.line}
			case tInt:
				x = &getitemExpr{obj: x, key: &constExpr{v: a.num, line: a.line}, line: a.line}
			default:
				return nil, p.errf(a.line, "expected an attribute name after '.', got %s", a)
			}
		case "[":
			p.pos++
			var err error
			if x, err = p.parseSubscript(x, t.line); err != nil {
				return nil, err
			}
		case "(":
			var err error
			if x, err = p.parseCall(x); err != nil {
				return nil, err
			}
		default:
			return x, nil
		}
	}
}

func (p *parser) parseSubscript(obj expr, line int) (expr, error) {
	var parts [3]expr
	isSlice := false
	for i := 0; i < 3; i++ {
		if !p.isOp(":") && !p.isOp("]") {
			x, err := p.parseExpr(true)
			if err != nil {
				return nil, err
			}
			parts[i] = x
		}
		if !p.isOp(":") {
			break
		}
		isSlice = true
		p.pos++
	}
	if err := p.expectOp("]"); err != nil {
		return nil, err
	}
	if isSlice {
		return &sliceExpr{obj: obj, start: parts[0], stop: parts[1], step: parts[2], line: line}, nil
	}
	if parts[0] == nil {
		return nil, p.errf(line, "empty subscript []")
	}
	return &getitemExpr{obj: obj, key: parts[0], line: line}, nil
}

func (p *parser) parseArgs() ([]expr, []kwarg, error) {
	if err := p.expectOp("("); err != nil {
		return nil, nil, err
	}
	var args []expr
	var kws []kwarg
	for !p.isOp(")") {
		if len(args)+len(kws) > 0 {
			if err := p.expectOp(","); err != nil {
				return nil, nil, err
			}
			if p.isOp(")") {
				break
			}
		}
		if p.isOp("*") || p.isOp("**") {
			return nil, nil, p.unsupported(p.cur().line, "*args/**kwargs in calls are not supported by chattmpl")
		}
		if p.cur().kind == tName && p.peek(1).kind == tOp && p.peek(1).val == "=" {
			name := p.next().val
			p.pos++
			x, err := p.parseExpr(true)
			if err != nil {
				return nil, nil, err
			}
			kws = append(kws, kwarg{name: name, x: x})
			continue
		}
		if len(kws) > 0 {
			return nil, nil, p.errf(p.cur().line, "positional argument follows keyword argument")
		}
		x, err := p.parseExpr(true)
		if err != nil {
			return nil, nil, err
		}
		args = append(args, x)
	}
	p.pos++
	return args, kws, nil
}

func (p *parser) parseCall(fn expr) (expr, error) {
	line := p.cur().line
	args, kws, err := p.parseArgs()
	if err != nil {
		return nil, err
	}
	return &callExpr{fn: fn, args: args, kwargs: kws, line: line}, nil
}

func (p *parser) parseFilterExpr(x expr) (expr, error) {
	for {
		switch {
		case p.isOp("|"):
			p.pos++
			f, err := p.parseFilter(x)
			if err != nil {
				return nil, err
			}
			x = f
		case p.isName("is"):
			var err error
			if x, err = p.parseTest(x); err != nil {
				return nil, err
			}
		case p.isOp("("):
			var err error
			if x, err = p.parseCall(x); err != nil {
				return nil, err
			}
		default:
			return x, nil
		}
	}
}

func (p *parser) dottedName() (string, int, error) {
	t := p.cur()
	name, err := p.expectName()
	if err != nil {
		return "", 0, err
	}
	for p.isOp(".") {
		p.pos++
		n, err := p.expectName()
		if err != nil {
			return "", 0, err
		}
		name += "." + n
	}
	return name, t.line, nil
}

func (p *parser) parseFilter(obj expr) (*filterExpr, error) {
	name, line, err := p.dottedName()
	if err != nil {
		return nil, err
	}
	fn, ok := filters[name]
	if !ok {
		return nil, &Error{Kind: ErrUnsupported, Line: line, Msg: fmt.Sprintf("no filter named '%s' (chattmpl implements: %s)", name, strings.Join(sortedKeys(filters), ", "))}
	}
	f := &filterExpr{obj: obj, name: name, fn: fn, line: line}
	if p.isOp("(") {
		if f.args, f.kwargs, err = p.parseArgs(); err != nil {
			return nil, err
		}
	}
	return f, nil
}

func (p *parser) parseTest(obj expr) (expr, error) {
	line := p.next().line // 'is'
	negated := false
	if p.isName("not") {
		p.pos++
		negated = true
	}
	name, _, err := p.dottedName()
	if err != nil {
		return nil, err
	}
	fn, ok := tests[name]
	if !ok {
		return nil, &Error{Kind: ErrUnsupported, Line: line, Msg: fmt.Sprintf("no test named '%s' (chattmpl implements: %s)", name, strings.Join(sortedKeys(tests), ", "))}
	}
	t := &testExpr{obj: obj, name: name, fn: fn, line: line}
	c := p.cur()
	switch {
	case c.kind == tOp && c.val == "(":
		if t.args, t.kwargs, err = p.parseArgs(); err != nil {
			return nil, err
		}
	case (c.kind == tName || c.kind == tString || c.kind == tInt || c.kind == tFloat ||
		c.kind == tOp && (c.val == "[" || c.val == "{")) &&
		!(c.kind == tName && (c.val == "else" || c.val == "or" || c.val == "and")):
		if c.kind == tName && c.val == "is" {
			return nil, p.errf(c.line, "you cannot chain multiple tests with 'is'")
		}
		a, err := p.parsePrimary()
		if err != nil {
			return nil, err
		}
		if a, err = p.parsePostfix(a); err != nil {
			return nil, err
		}
		t.args = []expr{a}
	}
	if negated {
		return &unaryExpr{op: "not", x: t, line: line}, nil
	}
	return t, nil
}
